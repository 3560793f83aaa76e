"""Call sites: one launch of a kernel family on a stream someone else owns, into memory someone else allocated.

epjit.jax runs dispatch and combine inside an XLA program (jax.experimental.buffer_callback): XLA allocates every
output and every scratch array, hands the callback its own stream, and, with command buffers, captures the launch
into a CUDA graph that it replays, calling the callback again only when some buffer moved. So a site:

- is built once per call site while JAX traces, outside the callback: the plan, the kernels' constant arguments
  and the buffer set are fixed there (nothing is decided per run);
- declares its outputs (shape and dtype name), scratch included: the callback allocates nothing;
- launches on the caller's stream only (no event, no communication stream, no host wait), so what it queues can be
  captured; refusals the GPU finds stay on the device (the dispatch handle's status word, the low-latency status
  words, the graph record of normal-mode notify) and are raised by the Buffer's next eager call or
  ``Buffer.synchronize()``.

Buffer sets of low-latency mode. The eager path alternates the two sets on the host, a call at a time. A site takes
a fixed set instead: every dispatch site set 0, every combine site set 1. The kernels keep each set's epoch on the
device (LowLatencySync.epoch, advanced by a call's last block) and wait for every peer's ack of the set's previous
call before writing into it, so any sequence of sets is correct as long as every rank runs the same sequence, which
one SPMD program does; a dispatch and the combine after it on different sets only keeps the alternation's slack (a
call waits for the acks of the call two before it, not of the one just before). Eager calls between jitted ones keep
their own alternation on the same device epochs.

An int64 array here is given as int32 pairs (``[..., 2]``, little-endian: the low word then the sign), which JAX
builds without 64-bit mode; FP8 travels as uint8 of the same shape.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import ArgumentError, EpjitError, with_rank
from ..kernels.intranode import NUM_THREADS, normal_grid
from ..kernels.low_latency import LOW_LATENCY_THREADS
from .layout import Layout
from .low_latency import PHASE_RECV, PHASE_SEND, LowLatency, meta_offsets
from .notify import FLAG_CAPTURED

DISPATCH_SET, COMBINE_SET = 0, 1  # the low-latency buffer set of every dispatch site and every combine site
_ALIGN_INTS = 64  # int32 elements: 256-byte aligned parts, as the eager allocations

Output = tuple[tuple[int, ...], str]  # an output's shape and dtype name (epjit.arrays.DTYPES)


def _executing(ctx: Any) -> bool:
    """Whether XLA runs the callback to launch (its EXECUTE stage); the other stages prepare resources."""
    stage = getattr(ctx, "stage", None)
    return stage is None or getattr(stage, "name", "EXECUTE") == "EXECUTE"


# A DLTensor's data pointer is at +0 and its byte_offset at +40 (see epjit.arrays.dlpack for the capsule layout).
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def address(buffer: Any) -> int:
    """The device address of an XLA buffer: from ``__cuda_array_interface__``, else (a dtype that interface has no
    code for, such as bfloat16 on some versions) from its DLPack tensor."""
    try:
        return int(buffer.__cuda_array_interface__["data"][0])
    except (AttributeError, TypeError, ValueError, KeyError):
        capsule = buffer.__dlpack__()
        tensor = _capsule_pointer(capsule, b"dltensor")
        data = ctypes.c_uint64.from_address(tensor).value
        return data + ctypes.c_uint64.from_address(tensor + 40).value


def stream_of(ctx: Any) -> int:
    """XLA's stream for this callback (a CUstream address)."""
    try:
        return int(ctx.stream)
    except Exception as e:  # noqa: BLE001 - XLA raises its own error types off the GPU
        raise EpjitError(with_rank(f"an epjit call inside jax.jit runs on the GPU platform only ({e})")) from None


def parts(shapes: list[tuple[int, ...]]) -> tuple[list[int], int]:
    """Element offsets of int32 parts of these shapes in one array, each 256-byte aligned, and its length."""
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        total += (math.prod(shape) + _ALIGN_INTS - 1) // _ALIGN_INTS * _ALIGN_INTS
    return offsets, max(total, 1)


# ------------------------------------------------------------------------------------------------------ low latency


class LowLatencyDispatchSite:
    """low_latency_dispatch of ``num_tokens`` x top-``num_topk``. Inputs: x [N, H] bf16, topk_idx [N, K, 2] int32
    (int64 bits). Outputs: recv_x [L, R*M, H] (uint8 FP8 bits, or bf16), recv_scales [L, R*M, H/128] (FP8 only:
    float32, or uint8 with use_ue8m0), meta [n] int32 (src_info, topk_slot, layout_range, recv_count:
    epjit.ops.low_latency.meta_offsets)."""

    def __init__(self, ops: LowLatency, num_tokens: int, num_topk: int, use_fp8: bool, round_scale: bool,
                 use_ue8m0: bool) -> None:
        self.ops, self.use_fp8 = ops, use_fp8
        plan = ops.dispatch_plan("jax", num_tokens, num_topk, use_fp8, round_scale, use_ue8m0)
        self.shared_bytes = plan.shared_bytes
        local, rows, ranks = plan.meta_shape
        self.meta_offsets = meta_offsets(local, rows, ranks)
        self.args = plan.args.set(set=DISPATCH_SET, phases=PHASE_SEND | PHASE_RECV, cumulative_stats=0)
        hidden = ops.hidden
        self.outputs: list[Output] = [((local, rows, hidden), "uint8" if use_fp8 else "bfloat16")]
        if use_fp8:
            self.outputs.append(((local, rows, hidden // 128), "uint8" if use_ue8m0 else "float32"))
        self.outputs.append(((self.meta_offsets[-1],), "int32"))

    def launch(self, ctx: Any, outs: Any, *ins: Any) -> None:
        if not _executing(ctx):
            return
        check_sets(self.ops, DISPATCH_SET)
        recv_x, scales = address(outs[0]), address(outs[1]) if self.use_fp8 else 0
        meta = address(outs[-1])
        src, slot, rng, count, _ = self.meta_offsets
        self.args.set(x=address(ins[0]), topk_idx=address(ins[1]), recv_x=recv_x, recv_scales=scales,
                      recv_src_info=meta + 4 * src, recv_topk_slot=meta + 4 * slot, layout_range=meta + 4 * rng,
                      recv_count=meta + 4 * count)
        self.ops.module.launch(self.args, self.ops.num_sms, LOW_LATENCY_THREADS, shared_mem=self.shared_bytes,
                               stream=stream_of(ctx))


class LowLatencyCombineSite:
    """low_latency_combine of ``num_tokens`` x top-``num_topk``. Inputs: y [L, R*M, H] bf16, topk_idx [N, K, 2] int32
    (int64 bits), topk_weights [N, K] float32, meta (the dispatch's). Output: out [N, H] bf16."""

    def __init__(self, ops: LowLatency, num_tokens: int, num_topk: int) -> None:
        self.ops = ops
        plan = ops.combine_plan("jax", num_tokens, num_topk, False)
        self.args = plan.args.set(set=COMBINE_SET, phases=PHASE_SEND | PHASE_RECV)
        local, rows = ops.num_experts // ops.num_ranks, ops.num_ranks * ops.num_max_tokens
        self.meta_offsets = meta_offsets(local, rows, ops.num_ranks)
        self.outputs: list[Output] = [((num_tokens, ops.hidden), "bfloat16")]

    def launch(self, ctx: Any, outs: Any, *ins: Any) -> None:
        if not _executing(ctx):
            return
        check_sets(self.ops, COMBINE_SET)
        meta = address(ins[3])
        src, slot, rng = self.meta_offsets[:3]
        self.args.set(y=address(ins[0]), topk_idx=address(ins[1]), topk_weights=address(ins[2]),
                      src_info=meta + 4 * src, topk_slot=meta + 4 * slot, layout_range=meta + 4 * rng,
                      out=address(outs[0]))
        self.ops.module.launch(self.args, self.ops.num_sms, LOW_LATENCY_THREADS, stream=stream_of(ctx))


def check_sets(ops: LowLatency, s: int) -> None:
    """Refuse a launch into a set an eager call's receive hook still owns, or on a closed Buffer."""
    if ops.closed:
        raise EpjitError(with_rank("this Buffer is closed"))
    if ops.pending[s] is not None:
        raise ArgumentError(with_rank(f"a jitted low-latency call uses buffer set {s}, whose eager "
                                      f"{ops.pending[s]} has a receive hook that has not run: call that hook first"))


# ------------------------------------------------------------------------------------------------------ normal mode


class HandleSizes(NamedTuple):
    """What a normal-mode combine plan reads of a dispatch handle (epjit.ops.intranode.Intranode.combine_plan)."""

    num_tokens: int
    hidden: int
    num_topk: int
    num_channels: int


@dataclass(frozen=True)
class HandleParts:
    """Where a jitted dispatch's handle keeps its int32 arrays, in one array of ``total`` ints: rank_prefix_matrix
    [R, R], channel_prefix_matrix [R, C], recv_channel_offset [R, C], send_head [N, R], recv_src_idx [W], status [1]
    (what notify found: 0 accepted; every combine of the handle does nothing unless 0)."""

    offsets: tuple[int, ...]
    total: int

    @staticmethod
    def of(num_ranks: int, num_channels: int, num_tokens: int, rows: int) -> HandleParts:
        r, c = num_ranks, num_channels
        offsets, total = parts([(r, r), (r, c), (r, c), (num_tokens, r), (rows,), (1,)])
        return HandleParts(tuple(offsets), total)

    def ptrs(self, base: int) -> tuple[int, ...]:
        return tuple(base + 4 * o for o in self.offsets)


class NormalDispatchSite:
    """A normal-mode dispatch inside one NVLink node with ``num_worst_tokens`` rows: the layout kernel, notify and
    dispatch, or, with ``replay``, notify (counts from the handle) and dispatch of a handle's routing (combine's
    backward). Inputs: x [N, H] bf16 (or uint8 FP8 bits and scales [N, H/128] float32), then, for a new routing,
    topk_idx [N, K, 2] int32 (int64 bits) and topk_weights [N, K] float32; for a replay the handle's ints and
    is_token_in_rank. Outputs: recv_x [W, H], recv_scales [W, H/128] (FP8), then for a new routing recv_topk_idx
    [W, K, 2] int32 (int64 bits), recv_topk_weights [W, K] float32, the handle's ints [n] int32 (HandleParts) and
    the layout's scratch [n] uint8 (is_token_in_rank inside); for a replay the handle's ints only."""

    def __init__(self, front: Any, plan: Any, layout: Any, parts_: HandleParts, replay: bool) -> None:
        self.ops, self.plan, self.layout, self.parts, self.replay = front.ops, plan, layout, parts_, replay
        self.layout_module = front.layout_ops.module
        self.num_channels = plan.num_channels
        self.in_rank_offset = layout.offsets[3] if layout is not None else 0  # bytes into the layout scratch
        self.grid = normal_grid(plan.num_channels, self.ops.num_device_sms)
        self.host_out = self.ops.records.graph.device_ptr  # written by notify only when it refuses the call
        self.notify = plan.notify_args.set(flags=plan.flags | FLAG_CAPTURED, host_out=self.host_out,
                                           recv_capacity=plan.num_worst_tokens, timeline=0)
        self.dispatch = plan.dispatch_args.set(timeline=0)
        if replay:
            self.notify.set(num_tokens_per_rank=0, num_tokens_per_expert=0, invalid_ids=0)
        w, h, k = plan.num_worst_tokens, plan.hidden, plan.num_topk
        self.outputs: list[Output] = [((w, h), "uint8" if plan.fp8 else "bfloat16")]
        if plan.fp8:
            self.outputs.append(((w, plan.num_scales), "float32"))
        if not replay:
            self.outputs += [((w, k, 2), "int32"), ((w, k), "float32")]
        self.outputs.append(((parts_.total,), "int32"))
        if not replay:
            self.outputs.append(((layout.offsets[4],), "uint8"))

    def launch(self, ctx: Any, outs: Any, *ins: Any) -> None:
        if not _executing(ctx):
            return
        if self.ops.records.pool is None:
            raise EpjitError(with_rank("this Buffer is closed"))
        stream, plan = stream_of(ctx), self.plan
        fp8 = 1 if plan.fp8 else 0
        x, scales = address(ins[0]), address(ins[1]) if fp8 else 0
        recv_x, recv_scales = address(outs[0]), address(outs[1]) if fp8 else 0
        rank_prefix, channel_prefix, offset, send_head, recv_src, status = self.parts.ptrs(address(outs[1 + fp8 + (
            0 if self.replay else 2)]))
        if self.replay:  # the handle's prefix matrices and is_token_in_rank, its counts
            old = self.parts.ptrs(address(ins[1 + fp8]))
            rank_prefix, channel_prefix, in_rank = old[0], old[1], address(ins[2 + fp8])
            idx = weights = recv_idx = recv_weights = 0
        else:
            idx, weights = address(ins[1 + fp8]), address(ins[2 + fp8])
            recv_idx, recv_weights = address(outs[1 + fp8]), address(outs[2 + fp8])
            base, o = address(outs[-1]), self.layout.offsets
            in_rank = self._layout(stream, idx, base)
            self.notify.set(num_tokens_per_rank=base, num_tokens_per_expert=base + o[1], invalid_ids=base + o[2])
        self.notify.set(is_token_in_rank=in_rank, rank_prefix_matrix=rank_prefix,
                        channel_prefix_matrix=channel_prefix, call_status=status)
        self.ops.notify_module.launch(self.notify, 1 + self.ops.num_ranks, 128, stream=stream)
        self.dispatch.set(x=x, x_scales=scales, topk_idx=idx, topk_weights=weights, is_token_in_rank=in_rank,
                          channel_prefix_matrix=channel_prefix, rank_prefix_matrix=rank_prefix, call_status=status,
                          recv_x=recv_x, recv_x_scales=recv_scales, recv_src_idx=recv_src, recv_topk_idx=recv_idx,
                          recv_topk_weights=recv_weights, recv_channel_offset=offset, send_head=send_head)
        plan.module.launch(self.dispatch, self.grid, NUM_THREADS, stream=stream)

    def _layout(self, stream: int, idx: int, base: int) -> int:
        """Count topk_idx into the layout scratch at ``base`` (as get_dispatch_layout); is_token_in_rank's address."""
        lp = self.layout
        if lp.counts_bytes:
            import cupy

            cupy.cuda.runtime.memsetAsync(base, 0, lp.counts_bytes, stream)
        o = lp.offsets
        lp.args.set(topk_idx=idx, num_tokens_per_rank=base, num_tokens_per_expert=base + o[1],
                    num_tokens_per_rdma_rank=0, is_token_in_rank=base + o[3], invalid_ids=base + o[2])
        self.layout_module.launch(lp.args, lp.grid, 256, shared_mem=lp.shared_bytes, stream=stream)
        return base + o[3]


class NormalCombineSite:
    """A normal-mode combine inside one NVLink node on a jitted dispatch's handle. Inputs: y [W, H] bf16, the
    handle's ints, and, ``with_weights``, y_topk_weights [W, K] float32. Outputs: out [N, H] bf16, and, with weights,
    out_topk_weights [N, K] float32 (each token's weights summed over the ranks that returned a row)."""

    def __init__(self, plan: Any, parts_: HandleParts, sizes: HandleSizes, with_weights: bool) -> None:
        self.plan, self.parts, self.with_weights = plan, parts_, with_weights
        self.args = plan.args.set(bias0=0, bias1=0, timeline=0)
        self.outputs: list[Output] = [((sizes.num_tokens, sizes.hidden), "bfloat16")]
        if with_weights:
            self.outputs.append(((sizes.num_tokens, sizes.num_topk), "float32"))

    def launch(self, ctx: Any, outs: Any, *ins: Any) -> None:
        if not _executing(ctx):
            return
        rank_prefix, _, offset, send_head, _, status = self.parts.ptrs(address(ins[1]))
        w = self.with_weights
        self.args.set(y=address(ins[0]), y_topk_weights=address(ins[2]) if w else 0, out_x=address(outs[0]),
                      out_topk_weights=address(outs[1]) if w else 0, rank_prefix_matrix=rank_prefix,
                      recv_channel_offset=offset, send_head=send_head, dispatch_status=status)
        self.plan.module.launch(self.args, self.plan.grid, NUM_THREADS, stream=stream_of(ctx))


def layout_plan(layout: Layout, num_tokens: int, num_topk: int, num_experts: int) -> Any:
    """The layout kernel's plan of a jitted dispatch (its scratch is an XLA output, so nothing is allocated)."""
    return layout.plan("jax", "cupy", num_tokens, num_topk, num_experts)


__all__ = ["COMBINE_SET", "DISPATCH_SET", "HandleParts", "HandleSizes", "LowLatencyCombineSite",
           "LowLatencyDispatchSite", "NormalCombineSite", "NormalDispatchSite", "address", "layout_plan", "stream_of"]
