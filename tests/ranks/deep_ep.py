"""Run by every rank under torchrun: DeepEP's V1 API (epjit.deep_ep, installed as ``deep_ep``) driven the way
framework code drives DeepEP, checked against epjit.reference.

- Megatron-LM's fused_a2a: the buffer sized by Config's hints, ``EventOverlap(EventHandle())`` as previous_event,
  async_finish and allocate_on_comm_stream, layout then dispatch, ``current_stream_wait()``, combine with the
  received weights (dispatch's backward), and a dispatch that replays the handle (combine's backward);
- vLLM's DeepEP high-throughput path: FP8 input (tokens, scales), the scales row-major and a column-major view,
  default configs, no events;
- vLLM's and SGLang's low-latency paths: a low-latency Buffer sized by get_low_latency_rdma_size_hint, FP8 with
  plain and UE8M0 scales checked in DeepEP's layout, the receive hook, async_finish, combine into ``out``, and
  DeepEP's own test's zero-copy combine (the outputs written into get_next_low_latency_combine_buffer's tensor,
  another tensor passed as x).

With ``--num-nvl-ranks V`` below the ranks, the epjit group is made first with every V consecutive ranks one NVLink
node (virtual nodes of one host), so the DeepEP Buffers run across nodes: the normal-mode one on epjit's internode
kernels, sized by epjit's hints; its layouts' ``num_tokens_per_rdma_rank`` and its combines are checked against the
reference's per-node counts and two-level combine. Inside one node ``num_tokens_per_rdma_rank`` must be None.

argv: ``gloo`` or ``nccl`` (the backend of the process group the script makes), then optionally
``--num-nvl-ranks V``. Prints ``RESULT {json}`` per rank.

    torchrun --standalone --nproc-per-node 4 tests/ranks/deep_ep.py gloo --num-nvl-ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from intranode import Mismatch, make_inputs, same, to_numpy, to_torch  # tests/ranks/intranode.py, beside this
from low_latency import expected_combine, expert_outputs  # tests/ranks/low_latency.py

import epjit
import epjit.deep_ep
from epjit import reference

epjit.deep_ep.install()  # the one line a DeepEP user adds; then the framework's own imports:
from deep_ep import Buffer  # noqa: E402
from deep_ep.utils import EventHandle, EventOverlap  # noqa: E402

HIDDEN, TOPK, EXPERTS = 2048, 4, 64


def ll_sizes(R: int) -> tuple[int, int, int]:
    """The low-latency Buffer's (num_max_dispatch_tokens_per_rank, hidden, num_experts): 8 experts a rank."""
    return 32, 2048, 8 * R


def normal_buffer(group, nvl: int | None) -> Buffer:
    """Megatron's get_buffer: the largest hint of the default dispatch and combine configs. Across virtual nodes
    (``nvl`` ranks a node) epjit's hints instead: DeepEP's Config hints assume nodes of 8 ranks (0 RDMA bytes up to
    8 ranks), and the internode kernels need a symmetric heap for the nodes' leg."""
    size, hidden_bytes = group.size(), HIDDEN * 2
    if nvl is not None:
        sizes = (size, HIDDEN, TOPK, EXPERTS)
        return Buffer(group, epjit.Buffer.get_normal_size_hint(*sizes, num_nvl_ranks=nvl),
                      epjit.Buffer.get_rdma_size_hint(*sizes, num_nvl_ranks=nvl))
    nvl = rdma = 0
    for config in (Buffer.get_dispatch_config(size), Buffer.get_combine_config(size)):
        nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, size), nvl)
        rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, size), rdma)
    return Buffer(group, nvl, rdma)


def check_layout(name: str, per_rank, per_rdma, idx: np.ndarray, R: int, nvl: int | None) -> None:
    """get_dispatch_layout's tokens a rank, and a node across nodes (``num_tokens_per_rdma_rank``, DeepEP's second
    return; None inside one node), against the reference's layout of this rank's ``topk_idx``."""
    want = reference.get_dispatch_layout(idx, EXPERTS, R, nvl)
    same(f"{name} num_tokens_per_rank", to_numpy(per_rank), want.num_tokens_per_rank)
    if nvl is None:
        if per_rdma is not None:
            raise Mismatch(f"{name}: num_tokens_per_rdma_rank inside one node is {per_rdma!r}, not None")
        return
    same(f"{name} num_tokens_per_rdma_rank", to_numpy(per_rdma), want.num_tokens_per_rdma_rank)


def megatron_round(buffer: Buffer, rank: int, R: int, seed: int, nvl: int | None) -> None:
    """fused_dispatch forward and backward, fused_combine forward and backward, with async_finish."""
    xs, idxs, ws = make_inputs(seed, [100 + 13 * r for r in range(R)], HIDDEN, TOPK, EXPERTS, 0.1)
    ref = reference.dispatch(xs, idxs, ws, EXPERTS)
    x, idx, w = to_torch(xs[rank]), to_torch(idxs[rank]), to_torch(ws[rank])
    per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
        idx, EXPERTS, previous_event=EventOverlap(EventHandle()), async_finish=True, allocate_on_comm_stream=True)
    recv_x, recv_idx, recv_w, counts, handle, after = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=event, async_finish=True,
        allocate_on_comm_stream=True)
    after.current_stream_wait()
    check_layout("megatron", per_rank, per_rdma, idxs[rank], R, nvl)
    same("megatron recv_x", to_numpy(recv_x), ref[rank].x)
    same("megatron recv_topk_idx", to_numpy(recv_idx), ref[rank].topk_idx)
    same("megatron recv_topk_weights", to_numpy(recv_w), ref[rank].topk_weights)
    if list(counts) != list(ref[rank].num_recv_tokens_per_expert):
        raise Mismatch(f"megatron num_recv_tokens_per_expert {counts} != {list(ref[rank].num_recv_tokens_per_expert)}")

    # dispatch's backward: combine the gradients with the received weights
    grads = [(r_.x.astype(np.float32) * 0.5).astype(r_.x.dtype) for r_ in ref]
    grad_x, grad_w, after = buffer.combine(to_torch(grads[rank]), handle, topk_weights=recv_w.float(),
                                           previous_event=EventOverlap(EventHandle()), async_finish=True,
                                           allocate_on_comm_stream=True)
    after.current_stream_wait()
    want = reference.combine(grads, [r_.handle for r_ in ref], topk_weights=[r_.topk_weights for r_ in ref],
                             num_nvl_ranks=nvl)
    same("megatron combined grad_x", to_numpy(grad_x), want[rank].x)
    same("megatron combined grad_topk_weights", to_numpy(grad_w), want[rank].topk_weights)

    # fused_combine forward (no weights) and its backward: a dispatch replaying the handle
    combined, none, after = buffer.combine(to_torch(grads[rank]), handle=handle, async_finish=True,
                                           previous_event=EventOverlap(EventHandle()))
    after.current_stream_wait()
    want = reference.combine(grads, [r_.handle for r_ in ref], num_nvl_ranks=nvl)
    same("megatron fused_combine", to_numpy(combined), want[rank].x)
    ys = [(x_.astype(np.float32) * 2).astype(x_.dtype) for x_ in xs]
    replayed, *nones, after = buffer.dispatch(to_torch(ys[rank]), handle=handle,
                                              previous_event=EventOverlap(EventHandle()), async_finish=True)
    after.current_stream_wait()
    if none is not None or nones != [None, None, None, None]:
        raise Mismatch(f"combine without weights / cached dispatch returned {none}, {nones}")
    same("megatron cached dispatch", to_numpy(replayed), reference.dispatch(ys, idxs, None, EXPERTS)[rank].x)


def vllm_ht_round(buffer: Buffer, rank: int, R: int, seed: int, nvl: int | None, column_major: bool) -> None:
    """vLLM's DeepEPHTPrepareAndFinalize: FP8 (tokens, scales) in, default configs, async_finish=False; with
    ``column_major`` the scales a column-major view, as DeepGEMM-style quantisers hand them over. Across nodes the
    configs are still get_dispatch_config(R)'s: they do not know the node size, and the internode kernels take them
    (docs/deep_ep.md)."""
    xs, idxs, ws = make_inputs(seed, [64 + 7 * r for r in range(R)], HIDDEN, TOPK, EXPERTS, 0.2)
    cast = [reference.per_token_cast_to_fp8(x_) for x_ in xs]
    qs, scales = [c[0] for c in cast], [c[1] for c in cast]
    ref = reference.dispatch(qs, idxs, ws, EXPERTS, x_scales=scales)
    idx, w = to_torch(idxs[rank]), to_torch(ws[rank])
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(
        topk_idx=idx, num_experts=EXPERTS, previous_event=None, async_finish=False, allocate_on_comm_stream=False)
    check_layout("vllm", per_rank, per_rdma, idxs[rank], R, nvl)
    x_scales = to_torch(scales[rank])
    if column_major:
        x_scales = x_scales.T.contiguous().T
    token_data = (to_torch(qs[rank]).view(torch.float8_e4m3fn), x_scales)
    (recv_q, recv_s), recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x=token_data, handle=None, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
        expert_alignment=1, config=Buffer.get_dispatch_config(R), previous_event=None, async_finish=False,
        allocate_on_comm_stream=False)
    same("vllm recv_x", to_numpy(recv_q), ref[rank].x)
    same("vllm recv_x_scales", to_numpy(recv_s), ref[rank].x_scales)
    same("vllm recv_topk_idx", to_numpy(recv_idx), ref[rank].topk_idx)
    ys = [reference.fp8_to_float(r_.x, r_.x_scales).astype(xs[0].dtype) for r_ in ref]
    combined, _, _ = buffer.combine(x=to_torch(ys[rank]), handle=handle, topk_weights=None,
                                    config=Buffer.get_combine_config(R), previous_event=None, async_finish=False,
                                    allocate_on_comm_stream=False)
    want = reference.combine(ys, [r_.handle for r_ in ref], num_nvl_ranks=nvl)
    same("vllm combined", to_numpy(combined), want[rank].x)


def check_low_latency(name: str, recv, count, handle, want, use_fp8: bool, use_ue8m0: bool) -> None:
    """The DeepEP tuple against the reference: x, scales (in DeepEP's layout), counts, src_info, layout_range."""
    x, scales = recv if use_fp8 else (recv, None)
    src_info, layout_range, _, _, _ = handle
    counts = to_numpy(count)
    same(f"{name} recv_count", counts, want.recv_count)
    same(f"{name} layout_range", to_numpy(layout_range), want.layout_range)
    if scales is not None:
        rows = x.shape[1]
        packed = scales.shape[2]
        if scales.stride() != (packed * rows, 1, rows):
            raise Mismatch(f"{name}: scales strides {scales.stride()} are not DeepEP's column-major layout")
        # back to epjit's row-major layout (UE8M0: the int32 words' bytes, in memory order) for the reference
        scales = scales.contiguous().view(torch.uint8) if use_ue8m0 else scales.contiguous()
        scales = to_numpy(scales)
    x, src = to_numpy(x), to_numpy(src_info)
    for e, n in enumerate(counts.tolist()):
        same(f"{name} src_info[{e}]", src[e, :n], want.src_info[e, :n])
        same(f"{name} x[{e}]", x[e, :n], want.x[e, :n])
        if scales is not None:
            same(f"{name} x_scales[{e}]", scales[e, :n], want.x_scales[e, :n])


def low_latency_round(buffer: Buffer, rank: int, R: int, seed: int, m: int, hidden: int, experts: int,
                      use_fp8: bool, use_ue8m0: bool, hook: bool, async_finish: bool, zero_copy: bool) -> None:
    """vLLM's DeepEPLLPrepareAndFinalize (no hook, combine into out) and SGLang's (hook, or async_finish); with
    ``zero_copy`` DeepEP's own test's way: the expert outputs written into get_next_low_latency_combine_buffer's
    tensor, and another tensor (zeros here: its data must not be read) passed as x."""
    xs, idxs, ws = make_inputs(seed, [m - r for r in range(R)], hidden, TOPK, experts, 0.1)
    x, idx, w = to_torch(xs[rank]), to_torch(idxs[rank]), to_torch(ws[rank])
    recv, count, handle, event, recv_hook = buffer.low_latency_dispatch(
        x, idx, m, experts, use_fp8=use_fp8, round_scale=use_ue8m0, use_ue8m0=use_ue8m0, async_finish=async_finish,
        return_recv_hook=hook)
    if hook:
        recv_hook()
    if async_finish:
        event.current_stream_wait()
    torch.cuda.synchronize()
    want = reference.low_latency_dispatch(xs, idxs, m, experts, use_fp8=use_fp8, round_scale=use_ue8m0,
                                          use_ue8m0=use_ue8m0)
    name = (f"low latency seed={seed} fp8={use_fp8} ue8m0={use_ue8m0} hook={hook} async={async_finish} "
            f"zero_copy={zero_copy}")
    check_low_latency(name, recv, count, handle, want[rank], use_fp8, use_ue8m0)
    src_info, layout_range, *_ = handle
    y = to_torch(expert_outputs(to_numpy(src_info), to_numpy(layout_range), xs, rank, experts))
    out = torch.empty_like(x)
    if zero_copy:
        buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
        y = torch.zeros_like(y)
    combined, event, recv_hook = buffer.low_latency_combine(y, idx, w, handle, async_finish=async_finish,
                                                            zero_copy=zero_copy, return_recv_hook=hook, out=out)
    if hook:
        recv_hook()
    if async_finish:
        event.current_stream_wait()
    torch.cuda.synchronize()
    if combined.data_ptr() != out.data_ptr():
        raise Mismatch(f"{name}: combine(out=) returned another tensor")
    same(f"{name} combined", to_numpy(out), expected_combine(xs[rank], idxs[rank], ws[rank]))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=("gloo", "nccl"), help="the process group's backend")
    parser.add_argument("--num-nvl-ranks", type=int, default=None,
                        help="ranks an NVLink node (below the ranks: virtual nodes, the internode kernels)")
    return parser.parse_args()


def run_rounds(buffer: Buffer, ll: Buffer, rank: int, R: int, nvl: int | None, result: dict) -> None:
    """Megatron's and vLLM's normal-mode rounds, then the low-latency ones; counts the cases in ``result``."""
    m, hidden, experts = ll_sizes(R)
    for i in range(2):
        megatron_round(buffer, rank, R, 100 + i, nvl)
        vllm_ht_round(buffer, rank, R, 200 + i, nvl, column_major=i == 1)
        result["cases"] += 2
    for i, (fp8, ue8m0, hook, async_finish, zero_copy) in enumerate([
            (True, False, False, False, False), (True, True, False, False, False), (True, False, True, False, False),
            (True, True, True, False, False), (True, False, False, True, False), (False, False, True, False, False),
            (False, False, False, True, False), (True, False, False, False, True), (False, False, True, False, True)]):
        low_latency_round(ll, rank, R, 300 + i, m, hidden, experts, fp8, ue8m0, hook, async_finish, zero_copy)
        result["cases"] += 1
    result["ll_hint_matches"] = ll.num_rdma_bytes == epjit.Buffer.get_low_latency_size_hint(m, hidden, R, experts)


def local_buffers(buffer: Buffer, ll: Buffer, nvl: int | None) -> dict:
    """get_local_buffer_tensor: views over this rank's own NVLink and RDMA buffers at the epjit Buffers' addresses,
    written through one view and read through another; run after the rounds (the kernels keep state there)."""
    import cupy

    view = buffer.get_local_buffer_tensor(torch.int32, torch.Size([4, 8]), offset=1024)
    address, num_bytes = buffer._normal.local_memory()
    if view.data_ptr() != address + 1024 or view.shape != (4, 8) or view.dtype != torch.int32:
        raise Mismatch(f"NVLink view at {view.data_ptr():#x} {tuple(view.shape)} {view.dtype}, buffer at {address:#x}")
    view.copy_(torch.arange(32, dtype=torch.int32, device=view.device).view(4, 8))
    whole = buffer.get_local_buffer_tensor(torch.int32)
    if whole.numel() != num_bytes // 4 or not torch.equal(whole[256:288].cpu(), torch.arange(32, dtype=torch.int32)):
        raise Mismatch(f"the whole NVLink view ({whole.numel()} ints of {num_bytes} bytes) does not hold the writes")
    rdma_owner = buffer if nvl is not None else ll  # across nodes the normal Buffer's heap; else low latency's
    rdma = rdma_owner.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
    base, _ = (rdma_owner._normal if nvl is not None else rdma_owner._ll).local_memory(symmetric=True)
    if rdma.data_ptr() != base or rdma.numel() != rdma_owner.num_rdma_bytes:
        raise Mismatch(f"RDMA view at {rdma.data_ptr():#x}, {rdma.numel()} bytes; heap at {base:#x}")
    return {"nvl_ints": whole.numel(), "rdma_bytes": rdma.numel(), "cupy": cupy.__version__}


def main() -> int:
    args = parse_args()
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # NCCL's collectives run on the current device
    dist.init_process_group(args.backend)
    group = dist.group.WORLD
    R, rank = group.size(), group.rank()
    nvl = args.num_nvl_ranks if args.num_nvl_ranks is not None and args.num_nvl_ranks < R else None
    if args.num_nvl_ranks is not None:
        # Before any deep_ep Buffer: DeepEP's Buffer(group) takes epjit.init(torch_group=group), which returns the
        # group made here for the same process group, so both Buffers below see V-rank NVLink nodes.
        epjit.init(torch_group=group, num_nvl_ranks=args.num_nvl_ranks)
    result: dict = {"backend": args.backend, "rank": rank, "size": R, "cases": 0, "mismatch": None}
    buffer = normal_buffer(group, nvl)
    epjit_group = epjit.init()  # the group DeepEP's Buffer made (or took) over the process group
    torch.cuda.set_device(epjit_group.device)
    inner = buffer._normal  # the normal-mode epjit Buffer: which kernels its calls run, its heap
    result.update(num_nvl_ranks=epjit_group.num_nvl_ranks, rdma_bytes=inner.num_rdma_bytes,
                  kernels=inner._normal._spec_of(inner._normal.dispatch_config).family)
    m, hidden, experts = ll_sizes(R)
    # A Buffer of its own (as vLLM and SGLang make): across nodes an epjit Buffer serves one mode, and deep_ep
    # makes this one's epjit Buffer low-latency only (num_nvl_bytes=0).
    ll = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(m, hidden, R, experts), low_latency_mode=True,
                num_qps_per_rank=experts // R, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=True,
                use_fabric=False, explicitly_destroy=True)
    try:
        run_rounds(buffer, ll, rank, R, nvl, result)
        result["local_buffers"] = local_buffers(buffer, ll, nvl)
    except Mismatch as e:
        result["mismatch"] = str(e)[:400]
    finally:
        ll.destroy()
        buffer.destroy()
    epjit_group.close()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["mismatch"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
