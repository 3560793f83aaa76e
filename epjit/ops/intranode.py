"""Normal mode inside one NVLink node (cuda_src/intranode.cu): notify, dispatch through per-channel rings into
exactly-sized outputs, and combine by the dispatch's receipts.

This module owns the family's kernels and launches, its channel claims and the steps of a call; notify's host
records and their status bits are epjit.ops.notify's, and the records that cross the boundary (inputs, plans,
handle, results) epjit.ops.normal's, both shared with the internode family. Validation is the front's
(epjit.front.normal): what reaches here is a plan (what one shape of a call needs, built once) and the call's
inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .. import jit
from ..arrays import address
from ..config import Config
from ..errors import EpjitError, with_rank
from ..kernels.intranode import (
    CLAIMS_INTS,
    NOTIFY_TIMELINE_POINTS,
    NUM_THREADS,
    TIMELINE_POINTS,
    IntranodeCombineFp8Spec,
    IntranodeNotifySpec,
    IntranodeSpec,
    normal_grid,
    shrink_spec,
)
from ..memory import MappedHostArray, PeerMemory
from .loader import load
from .normal import (
    CombineInputs,
    CombinePlan,
    CombineResult,
    DispatchHandle,
    DispatchInputs,
    DispatchPlan,
    DispatchResult,
    DispatchShape,
    Ints,
    LayoutInputs,
)
from .notify import (
    FLAG_CAPTURED,
    STATUS_OVER_CAPACITY,
    HostRecords,
    RowEstimate,
    call_flags,
    expert_counts_at,
    refusal,
)
from .profile import Profile
from .shrink import NormalShrinkMask
from .streams import POISON_BYTE, Event, Outputs, Streams, caller_stream, is_capturing


class Intranode:
    """Normal mode of a Buffer inside one NVLink node: its kernels, channel claims, host records and estimates."""

    shrink: NormalShrinkMask | None = None  # shrink mode's mask and reports (set in __init__ where it is on)

    def __init__(self, mem: PeerMemory, streams: Streams, outputs: Outputs, profile: Profile, device: int,
                 num_experts: int, shrink_timeout_s: float | None = None) -> None:
        """``shrink_timeout_s``: shrink mode (the kernels' EPJIT_NORMAL_SHRINK builds), a peer that does not answer
        within it masked; None: without."""
        import cupy

        self.mem, self.streams, self.outputs, self.profile = mem, streams, outputs, profile
        self.device = device
        self.num_ranks = mem.group.size
        self.num_nvl_bytes = mem.nvl.num_bytes if mem.nvl is not None else 0
        if shrink_timeout_s is not None:
            self.shrink = NormalShrinkMask(mem, self.num_ranks, shrink_timeout_s, streams, device)
        self._modules: dict[Any, jit.Module] = {}
        self.notify_module = self.module(self._notify_spec())
        self.records = HostRecords(mem.group.rank, self.num_ranks, self.num_nvl_bytes, num_experts, mem.raise_for,
                                   self.FORWARDED)
        self.estimate = RowEstimate(self.num_ranks)
        try:
            with cupy.cuda.Device(device):
                # cuda_src/placement.cuh's ChannelClaims for dispatch, then for combine: zero before the first
                # launch; each launch's last block zeroes them for the next.
                self._claims = cupy.zeros(2 * CLAIMS_INTS, dtype=cupy.int32)
                self.num_device_sms = int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
                self._cuda_device = cupy.cuda.Device(device)  # (entered by each call's allocation: made once)
        except BaseException:
            self.records.close()
            raise
        base = int(self._claims.data.ptr)
        self.claims = (base, base + 4 * CLAIMS_INTS)

    FORWARDED = False  # whether notify's records count forwarded tokens (the internode family's do)

    def _notify_spec(self) -> Any:
        return IntranodeNotifySpec(self.num_ranks)

    def module(self, spec: Any) -> jit.Module:
        """The module of this spec (loaded on first use; in shrink mode, its shrink build)."""
        found = self._modules.get(spec)
        if found is None:
            found = self._modules[spec] = load(spec if self.shrink is None else shrink_spec(spec), self.device)
        return found

    def close(self) -> None:
        self.records.close()
        if self.shrink is not None:
            self.shrink.close()

    def check_pending(self, capturing: Callable[[], bool]) -> None:
        self.records.check(capturing)

    # ---------------------------------------------------------------------------------------------------- plans

    def dispatch_plan(self, shape: DispatchShape, spec: IntranodeSpec, config: Config) -> DispatchPlan:
        """What a dispatch of this shape needs (its arguments already checked by the front)."""
        s = shape
        num_scales = s.hidden // 128 if s.fp8 else 0
        module = self.module(spec)
        channels = config.num_channels
        table = self.mem.table_ptr
        notify = self.notify_module.spec.args(
            "intranode_notify", peers=table, num_tokens=s.num_tokens, num_channels=channels,
            num_slots=config.nvl_chunk_recv, hidden=s.hidden, num_topk=s.num_topk, num_scales=num_scales,
            num_experts=s.num_experts, expert_alignment=s.expert_alignment, cached=int(s.replay))
        dispatch = module.spec.args(
            "intranode_dispatch", peers=table, claims=self.claims[0], num_tokens=s.num_tokens, hidden=s.hidden,
            x_row_int4=s.hidden * (1 if s.fp8 else 2) // 16, num_scales=num_scales, num_topk=s.num_topk,
            num_experts=s.num_experts, num_channels=channels, num_slots=config.nvl_chunk_recv,
            num_max_send_tokens=config.nvl_chunk_send, num_worst_tokens=s.num_worst_tokens)
        return self._plan(s, channels, notify, dispatch, module)

    def _plan(self, s: DispatchShape, num_channels: int, notify: jit.KernelArgs, dispatch: jit.KernelArgs,
              module: jit.Module) -> DispatchPlan:
        """A dispatch plan of these launches' constant arguments: its flags, outputs and the record's length."""
        num_scales = s.hidden // 128 if s.fp8 else 0
        new_outputs = self._new_outputs(s.kind, s.hidden, num_scales, s.num_topk, s.fp8, s.with_idx, s.with_weights)
        return DispatchPlan(s.framework, s.kind, s.num_tokens, s.hidden, s.num_topk, num_scales, s.num_experts, s.fp8,
                            s.with_idx, s.with_weights, s.num_worst_tokens, num_channels,
                            call_flags(s.fp8, s.with_weights, s.with_idx, s.num_worst_tokens), new_outputs,
                            (s.hidden, num_scales, s.num_topk, s.num_topk),
                            expert_counts_at(self.num_ranks, self.FORWARDED)
                            + (0 if s.replay else s.num_experts // self.num_ranks),
                            notify, dispatch, module)

    def _new_outputs(self, kind: str, hidden: int, num_scales: int, num_topk: int, fp8: bool, with_idx: bool,
                     with_weights: bool) -> tuple[Callable[[int], Any] | None, ...]:
        """Allocators by rows of recv_x, recv_x_scales, recv_topk_idx and recv_topk_weights (None: not an output)."""
        out = self.outputs
        return (out.row_allocator(kind, hidden, out.dtype(kind, "float8_e4m3fn" if fp8 else "bfloat16")),
                out.row_allocator(kind, num_scales, out.dtype(kind, "float32")) if fp8 else None,
                out.row_allocator(kind, num_topk, out.dtype(kind, "int64")) if with_idx else None,
                out.row_allocator(kind, num_topk, out.dtype(kind, "float32")) if with_weights else None)

    def combine_plan(self, framework: str, kind: str, spec: IntranodeSpec | IntranodeCombineFp8Spec, config: Config,
                     handle: DispatchHandle, with_weights: bool) -> CombinePlan:
        """A combine's plan: bf16 with an IntranodeSpec, FP8 (intranode_combine_fp8) with its own spec."""
        module = self.module(spec)
        kernel = "intranode_combine_fp8" if isinstance(spec, IntranodeCombineFp8Spec) else "intranode_combine"
        args = module.spec.args(
            kernel, peers=self.mem.table_ptr, claims=self.claims[1], num_tokens=handle.num_tokens,
            hidden=handle.hidden, num_topk=handle.num_topk, num_channels=handle.num_channels,
            num_slots=config.nvl_chunk_recv, num_max_send_tokens=config.nvl_chunk_send, timeline=0)
        return self._combine_plan(framework, kind, handle, with_weights, args, module)

    def _combine_plan(self, framework: str, kind: str, handle: DispatchHandle, with_weights: bool,
                      args: jit.KernelArgs, module: jit.Module) -> CombinePlan:
        """A combine plan of these constant arguments: its outputs' allocators and its grid."""
        out = self.outputs
        new_out = out.allocator(kind, (handle.num_tokens, handle.hidden), out.dtype(kind, "bfloat16"))
        new_weights = out.allocator(kind, (handle.num_tokens, handle.num_topk), out.dtype(kind, "float32")) \
            if with_weights else None
        return CombinePlan(framework, kind, new_out, new_weights, normal_grid(handle.num_channels,
                                                                              self.num_device_sms), args, module)

    # ---------------------------------------------------------------------------------------------------- dispatch

    def _ints(self, plan: DispatchPlan, capacity: tuple[int, ...], handle: DispatchHandle | None) -> tuple[Ints, ...]:
        """rank_prefix_matrix and channel_prefix_matrix (a replayed handle's), recv_channel_offset, send_head,
        recv_src_idx and the status word of one dispatch, carved from one CuPy allocation on the communication
        stream: one allocation and no array objects."""
        r, num_channels = self.num_ranks, plan.num_channels
        shapes = [(r, r), (r, num_channels)] if handle is None else []
        shapes += [(r, num_channels), (plan.num_tokens, r), (capacity[0],), (1,)]
        parts = self._carve(shapes)
        return parts if handle is None else (handle.rank_prefix_ints, handle.channel_prefix_ints, *parts)

    def _carve(self, shapes: list[tuple[int, ...]]) -> tuple[Ints, ...]:
        """int32 arrays of these shapes, each 256-byte aligned, in one CuPy allocation on the communication stream
        (poisoned where outputs are)."""
        import cupy

        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += (math.prod(shape) + 63) // 64 * 64  # 256-byte aligned parts
        with self._cuda_device, self.streams.comm:  # (the current device may be another GPU's)
            owner = cupy.empty(max(total, 1), dtype=cupy.int32)
            if self.outputs.poison:
                owner.view(cupy.uint8).fill(POISON_BYTE)
        base = int(owner.data.ptr)
        return tuple(Ints(owner, o, shape, base + 4 * o) for o, shape in zip(offsets, shapes, strict=True))

    def dispatch(self, plan: DispatchPlan, inputs: DispatchInputs, layout: LayoutInputs | None,
                 handle: DispatchHandle | None, buffer_id: int, previous_event: Event | None,
                 async_finish: bool) -> DispatchResult:
        """Send every token to each rank owning one of its experts. The outputs are allocated before the counts
        are known, so the GPU runs dispatch right after notify instead of idling while the host waits for the
        counts: num_worst_tokens rows, a handle's exact rows, or an estimate (RowEstimate); when some rank's rows
        do not fit, notify stops the call on every rank and it runs again with the exact rows."""
        profile, streams = self.profile, self.streams
        profile.start()
        caller = caller_stream(plan.framework, self.device)
        # Only a dispatch that waits for no counts can be captured (worst-token outputs, or a replay whose handle
        # knows its rows): ask the stream only then.
        replayed = self._replay_record(handle)
        waits = plan.num_worst_tokens == 0 and replayed is None
        host, call = self.records.take(plan.num_experts, not waits and is_capturing(caller))
        flags = plan.flags | (FLAG_CAPTURED if call < 0 else 0)  # notify writes the graph's record only on refusal
        streams.begin(caller, previous_event)
        profile.mark("validated", streams.comm)
        capacity, estimated = self._capacity(plan, handle)
        counts, in_rank, in_rank_owner = self._counts(layout, handle)
        host_ints = host.ints
        grid = normal_grid(plan.num_channels, self.num_device_sms)
        notify, dispatch = plan.notify_args, plan.dispatch_args
        notify.set(is_token_in_rank=in_rank, flags=flags, host_out=host.device_ptr, **counts)
        dispatch.set(x=address(inputs.x), x_scales=address(inputs.x_scales), topk_idx=address(inputs.topk_idx),
                     topk_weights=address(inputs.topk_weights), is_token_in_rank=in_rank)
        record: list[int] = []
        for attempt in range(2):
            ints = self._ints(plan, capacity, handle)
            outs = tuple(new(capacity[0]) if new is not None else None for new in plan.new_outputs)
            profile.mark("allocated", streams.comm)
            host_ints[0], host_ints[1] = -1, 0
            self._launch_dispatch(plan, grid, capacity, ints, outs)
            # The caller's stream waits for the kernels now, before the host waits for the counts: else a host
            # slower than dispatch would put its own time on the caller's stream.
            event = streams.finish(caller, async_finish)
            if not waits:  # worst-token rows, or a replay's rows (its handle's)
                record = [] if plan.num_worst_tokens > 0 else replayed or []
                num_rows, per_expert_counts = plan.num_worst_tokens or record[0], []
                break
            self._wait_for_counts(host)
            profile.mark("host_synced")
            # the record's head and per-expert counts as Python ints in one read (each numpy index costs one)
            record = host_ints[:plan.record_ints].tolist()
            num_rows = record[0]
            if record[1]:
                if record[1] == STATUS_OVER_CAPACITY and estimated and attempt == 0:
                    capacity = self._exact(record)  # every rank stopped; each runs again with its exact sizes
                    self.estimate.retries += 1
                    continue
                error = refusal(host_ints, self.num_ranks, self.num_nvl_bytes, 0, forwarded=self.records.forwarded)
                if error is not None:
                    raise error
            self._saw(plan, record)
            per_expert_counts = self._after_counts(plan, record, handle, num_rows)
            profile.mark("counted")
            if num_rows < capacity[0]:
                outs = self._shrink(plan, outs, num_rows)
            profile.mark("shrunk")
            break
        if not waits and call >= 0:  # its record is read once this event is done
            self.records.add_pending(call, streams.mark(), host, plan.num_worst_tokens)
        new_handle = self._new_handle(ints, in_rank, in_rank_owner, record, num_rows, plan, buffer_id)
        if plan.kind == "torch":
            if async_finish:
                streams.used_by_comm((*outs, inputs.x, inputs.x_scales, inputs.topk_idx, inputs.topk_weights,
                                      *(layout.keep if layout is not None else ())))
        elif plan.framework != "cupy":  # CuPy callers take the CuPy arrays as they are (FP8 stays uint8 storage)
            outs = _hand_over(outs, plan.framework, caller, plan.fp8)
        result = DispatchResult(outs[0], outs[1], outs[2], outs[3], per_expert_counts, new_handle, event)
        profile.mark("returned")
        return result

    # The steps of dispatch a family of its own (internode) does its own way. A capacity is the rows of output
    # allocated, then (internode) the tokens this rank may forward.

    def _capacity(self, plan: DispatchPlan, handle: DispatchHandle | None) -> tuple[tuple[int, ...], bool]:
        """Rows of output to allocate before the counts, and whether they are an estimate."""
        if plan.num_worst_tokens > 0:
            return (plan.num_worst_tokens,), False
        if handle is not None and handle.num_recv_tokens >= 0:
            return (handle.num_recv_tokens,), False
        # no handle, or one from a worst-token dispatch (its row count never reached the host)
        return (self.estimate.rows(plan.num_tokens),), True

    @staticmethod
    def _counts(layout: LayoutInputs | None, handle: DispatchHandle | None) -> tuple[dict[str, Any], Any, Any]:
        """Notify's count arguments, and is_token_in_rank with what keeps it alive (a replay's, from its handle)."""
        if handle is None:
            assert layout is not None
            return ({"num_tokens_per_rank": layout.per_rank, "num_tokens_per_expert": layout.per_expert,
                     "invalid_ids": layout.invalid}, layout.in_rank, layout.in_rank_owner)
        return ({"num_tokens_per_rank": 0, "num_tokens_per_expert": 0, "invalid_ids": 0}, handle.in_rank_ptr,
                handle.in_rank_owner)

    @staticmethod
    def _replay_record(handle: DispatchHandle | None) -> list[int] | None:
        """What the host would read of notify's record for a replay of a handle whose rows it knows (their count,
        the only field a replay uses), or None where it must wait for the record. A replay's notify exchanges no
        counts (the handle brings them), so it can only refuse the call (ranks calling alike is all it checks):
        such a refusal is raised by the next call on the Buffer, as a worst-token dispatch's is."""
        if handle is None or handle.num_recv_tokens < 0:
            return None
        return [handle.num_recv_tokens]

    @staticmethod
    def _exact(record: list[int]) -> tuple[int, ...]:
        return (record[0],)

    def _saw(self, plan: DispatchPlan, record: list[int]) -> None:
        self.estimate.saw(plan.num_tokens, record[0])

    @staticmethod
    def _new_handle(ints: tuple[Ints, ...], in_rank: int, in_rank_owner: Any, record: list[int], num_rows: int,
                    plan: DispatchPlan, buffer_id: int) -> DispatchHandle:
        return DispatchHandle(ints, in_rank, in_rank_owner, record[0] if record else -1, num_rows, plan, buffer_id)

    def _launch_dispatch(self, plan: DispatchPlan, grid: int, capacity: tuple[int, ...], ints: tuple[Ints, ...],
                         outs: tuple[Any, ...]) -> None:
        profile, comm = self.profile, self.streams.comm_ptr
        rank_prefix, channel_prefix, recv_channel_offset, send_head, recv_src, status = ints
        notify = plan.notify_args.set(
            recv_capacity=capacity[0], rank_prefix_matrix=rank_prefix.ptr, channel_prefix_matrix=channel_prefix.ptr,
            call_status=status.ptr, timeline=profile.timeline("notify", 1 + self.num_ranks, NOTIFY_TIMELINE_POINTS))
        self.notify_module.launch(notify, 1 + self.num_ranks, 128, stream=comm)
        profile.mark("notify", self.streams.comm)
        dispatch = plan.dispatch_args.set(
            channel_prefix_matrix=channel_prefix.ptr, rank_prefix_matrix=rank_prefix.ptr, call_status=status.ptr,
            recv_x=address(outs[0]), recv_x_scales=address(outs[1]), recv_src_idx=recv_src.ptr,
            recv_topk_idx=address(outs[2]), recv_topk_weights=address(outs[3]),
            recv_channel_offset=recv_channel_offset.ptr, send_head=send_head.ptr,
            timeline=profile.timeline("dispatch", grid, TIMELINE_POINTS))
        plan.module.launch(dispatch, grid, NUM_THREADS, stream=comm)
        profile.mark("dispatch", self.streams.comm)

    def _after_counts(self, plan: DispatchPlan, record: list[int], handle: DispatchHandle | None,
                      num_recv: int) -> list[int]:
        """The tokens received per local expert (a replay has none), once notify's counts are in."""
        if handle is not None:
            if handle.num_recv_tokens >= 0 and num_recv != handle.num_recv_tokens:
                raise EpjitError(with_rank(f"cached dispatch received {num_recv} rows, the handle says "
                                           f"{handle.num_recv_tokens}"))
            return []
        return record[expert_counts_at(self.num_ranks):]

    @staticmethod
    def _shrink(plan: DispatchPlan, outs: tuple[Any, ...], rows: int) -> tuple[Any, ...]:
        """The outputs cut to the rows that arrived: torch tensors in place (the cheapest, with the sizes as separate
        arguments, which torch parses faster than a tuple), CuPy arrays as views."""
        if plan.kind == "torch":
            for o, cols in zip(outs, plan.output_cols, strict=True):
                if o is not None:
                    o.resize_(rows, cols)
            return outs
        return tuple(o[:rows] if o is not None else None for o in outs)

    def _wait_for_counts(self, host: MappedHostArray) -> None:
        """Wait until notify has filled the host record: spin on its first word, which notify writes last with a
        system-scope release (it starts at -1), as DeepEP's host does: the host sees the counts as soon as they
        land, not after the stream's later work or a synchronisation's wake-up. Every 4096 polls (~0.5 ms) the
        stream is queried with cudaStreamQuery itself, so a kernel error or a timeout trap, after which the word
        never comes, raises as a synchronisation would. Not more often: a query costs microseconds, and counts
        landing during one wait for it."""
        from cuda.bindings import runtime as cudart

        ints = host.ints
        stream_ptr = self.streams.comm_ptr
        polls = 0
        while ints[0] < 0:
            polls += 1
            if polls % 4096 == 0:
                err = cudart.cudaStreamQuery(stream_ptr)[0]
                if err == cudart.cudaError_t.cudaErrorNotReady:
                    continue
                if ints[0] >= 0:
                    break
                if err == cudart.cudaError_t.cudaSuccess:
                    raise EpjitError(with_rank("notify finished without publishing its counts"))
                self.mem.raise_for(EpjitError(with_rank(f"cudaStreamQuery: {err.name}")))

    # ---------------------------------------------------------------------------------------------------- combine

    def combine(self, plan: CombinePlan, inputs: CombineInputs, handle: DispatchHandle,
                previous_event: Event | None, async_finish: bool) -> CombineResult:
        """For each original token, the sum of the rows the ranks send back for it (+ bias): dispatch's adjoint."""
        profile, streams = self.profile, self.streams
        caller = caller_stream(plan.framework, self.device)
        streams.begin(caller, previous_event)
        out = plan.new_out()
        out_w = plan.new_out_weights() if plan.new_out_weights is not None else None
        # (the optional arrays' None read inline: a call here costs the host more than the test)
        w, bias0, bias1 = inputs.topk_weights, inputs.bias0, inputs.bias1
        args = plan.args.set(y=address(inputs.y), y_topk_weights=0 if w is None else address(w),
                             bias0=0 if bias0 is None else address(bias0), bias1=0 if bias1 is None else address(bias1),
                             out_x=address(out), out_topk_weights=0 if out_w is None else address(out_w),
                             **self._handle_args(handle))
        if profile.enabled:
            profile.start()
            profile.mark("validated", streams.comm)
            self._combine_timeline(args, plan)
        plan.module.launch(args, plan.grid, NUM_THREADS, stream=streams.comm_ptr)
        if profile.enabled:
            profile.mark("combine", streams.comm)
        event = streams.finish(caller, async_finish)
        if plan.kind == "torch":
            if async_finish:
                streams.used_by_comm((out, out_w, inputs.y, inputs.topk_weights, inputs.bias0, inputs.bias1))
        elif plan.framework != "cupy":
            out, out_w = _hand_over((out, out_w), plan.framework, caller, False)
        result = CombineResult(out, out_w, event)
        if profile.enabled:
            profile.mark("returned")
        return result


    def _combine_timeline(self, args: jit.KernelArgs, plan: CombinePlan) -> None:
        """EPJIT_PROFILE: stamps for this combine launch (a row a block)."""
        args.set(timeline=self.profile.timeline("combine", plan.grid, TIMELINE_POINTS))

    @staticmethod
    def _handle_args(handle: DispatchHandle) -> dict[str, int]:
        """What combine's kernel takes of the handle."""
        return {"rank_prefix_matrix": handle.rank_prefix_ints.ptr,
                "recv_channel_offset": handle.recv_channel_offset_ints.ptr, "send_head": handle.send_head_ints.ptr,
                "dispatch_status": handle.status_ints.ptr}


def _hand_over(outs: tuple[Any, ...], framework: str, caller: int, fp8: bool) -> tuple[Any, ...]:
    """CuPy outputs handed to torch or JAX through DLPack, with CuPy's current stream the caller's (so DLPack's
    stream handshake orders nothing more than the call itself did)."""
    from ..arrays import cupy_stream, from_cupy

    with cupy_stream(caller, 0):
        return tuple(None if o is None else from_cupy(o, framework, dtype="float8_e4m3fn" if fp8 and i == 0
                                                      else None, name="recv_x" if i == 0 else "output")
                     for i, o in enumerate(outs))
