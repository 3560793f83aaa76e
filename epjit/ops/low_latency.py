"""Low-latency mode (decode): every (token, chosen expert) goes straight to a fixed slot of the expert's rank in the
symmetric region (CUDA IPC memory inside one NVLink node, NVSHMEM's heap across nodes), with no count pass; combine
writes the expert outputs back into per-(token, k) slots at home and reduces them with the gate weights
(cuda_src/low_latency.cu, docs/layouts.md).

This module owns the family's protocol constants and status bits, the status words the kernels report through,
the two buffer sets and their receive hooks, the outputs and the launches. Validation is the front's
(epjit.front.low_latency): what reaches here is a plan (what one shape of a call needs, built once) and the call's
inputs record.

Status words (``host_status``, mapped host memory written by the kernels only): word 0 counts the reports and is
released after the counts; word 1 + b counts the calls that raised status bit b. The host remembers what it has
raised and raises what the counts gained since, so a repeated problem is raised again and two reports between two
looks are raised together.

Shrink mode (a Buffer made with enable_shrink: the kernels' EPJIT_LL_SHRINK build, docs/reliability.md; its mask
and reports: epjit.ops.shrink): a kernel wait that times out on a peer masks it and raises status bit
STATUS_RANK_MASKED, which the host turns into a warning and a report instead of an error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import jit
from ..arrays import address
from ..errors import ArgumentError, EpjitError, with_rank
from ..kernels.low_latency import (
    LOW_LATENCY_THREADS,
    SHRINK_BUILDS,
    SYNC_BYTES,
    TIMELINE_POINTS,
    WAIT_STATS_BUILDS,
    LowLatencyPutsSpec,
    LowLatencySpec,
    LowLatencyStoresSpec,
    clean_words_offset,
    dispatch_shared_bytes,
    low_latency_size_hint,
)
from ..memory import IpcHeap, MappedHostArray, PeerMemory, SymmetricHeap
from .loader import load
from .profile import Profile
from .shrink import ShrinkMask, low_latency_shrink, sync_ints
from .streams import Event, Outputs, Streams, caller_stream, is_capturing

# Protocol constants of cuda_src/low_latency.cu (tests/test_low_latency_layout.py holds them against it).
PHASE_SEND, PHASE_RECV = 1, 2  # kPhaseSend, kPhaseRecv: which halves a launch runs
FLAG_FP8, FLAG_ROUND_SCALE, FLAG_UE8M0 = 1, 2, 4  # kFlagFp8, kFlagRoundScale, kFlagUe8m0
# Status bits (kLowLatencyInvalidIds, ...): what a kernel found wrong, reported through the status words.
STATUS_INVALID_IDS, STATUS_SLOT_OVERFLOW, STATUS_META_MISMATCH, STATUS_LAYOUT_TOO_BIG = 1, 2, 4, 8
STATUS_RANK_MASKED = 16  # kLowLatencyRankMasked: shrink mode, a wait masked a peer (a warning, not an error)
STATUS_BIT_COUNT = 5  # kStatusBitCount: host_status holds [0] reports, [1 + b] calls that raised bit b
# Blocks of a low-latency kernel, one an SM: both receive halves are bound by what an SM loads, so they want many;
# beyond 128 nothing was gained (docs/history.md, "Low-latency fences, acks, flags and blocks").
MAX_BLOCKS = 128

_PHASE_SUFFIX = {PHASE_SEND: ".send", PHASE_RECV: ".recv", PHASE_SEND | PHASE_RECV: ""}
_META_ALIGN = 64  # int32 elements: each part of a dispatch's metadata allocation starts 256-byte aligned


def _kind(framework: str) -> str:
    """Where a call's outputs come from (streams.Outputs): torch's allocator for torch callers, CuPy's pool else."""
    return "torch" if framework == "torch" else "cupy"


def _cupy() -> Any:
    import cupy

    return cupy


def kernels_for(force_puts: bool, heap: SymmetricHeap | IpcHeap | None, shrink: bool = False) -> LowLatencySpec:
    """The build of the kernels this Buffer runs: without NVSHMEM where every peer is reached by pointer and puts are
    not forced; with NVSHMEM's puts where one is not (or puts are forced on its heap); with the put path as NVLink
    stores where puts are forced on IPC memory (EPJIT_RDMA_BY_STORES). ``shrink``: that build in shrink mode."""
    if not needs_puts(force_puts, heap):
        spec: LowLatencySpec = LowLatencySpec()
    else:
        spec = LowLatencyStoresSpec() if isinstance(heap, IpcHeap) else LowLatencyPutsSpec()
    return SHRINK_BUILDS[type(spec)]() if shrink else spec


def needs_puts(force_puts: bool, heap: SymmetricHeap | IpcHeap | None) -> bool:
    """Whether the kernels need their build with NVSHMEM puts (LowLatencyPutsSpec): puts forced, or a peer without
    an NVLink pointer. The build without NVSHMEM's device library launches faster (docs/history.md)."""
    return force_puts or heap is None or not heap.has_direct_peers


def meta_offsets(num_local: int, rows: int, num_ranks: int) -> tuple[int, int, int, int, int]:
    """Element offsets of a dispatch's metadata parts (src_info, topk_slot, layout_range, recv_count) in its one
    int32 allocation, each 256-byte aligned, and the total."""
    def up(n: int) -> int:
        return (n + _META_ALIGN - 1) // _META_ALIGN * _META_ALIGN

    src, slot = 0, up(num_local * rows)
    rng = slot + up(num_local * rows)
    count = rng + up(2 * num_local * num_ranks)
    return src, slot, rng, count, count + up(num_local)


_META_PARTS = ("src_info", "topk_slot", "layout_range", "recv_count")


class _Meta:
    """A dispatch's int32 metadata, one allocation: src_info and topk_slot [L, R*max], layout_range [L, R] int64,
    recv_count [L]. The kernels take addresses into it; the caller's views of it are made when first read."""

    __slots__ = ("owner", "framework", "ptrs", "offsets", "shape", "_views")

    def __init__(self, owner: Any, framework: str, ptr: int, offsets: tuple[int, ...],
                 shape: tuple[int, int, int]) -> None:
        self.owner, self.framework, self.offsets, self.shape = owner, framework, offsets, shape
        self.ptrs = (ptr + 4 * offsets[0], ptr + 4 * offsets[1], ptr + 4 * offsets[2], ptr + 4 * offsets[3])
        self._views: dict[str, Any] = {}

    def view(self, name: str) -> Any:
        found = self._views.get(name)
        if found is None:
            found = self._views[name] = self._make(name)
        return found

    def _make(self, name: str) -> Any:
        start = self.offsets[_META_PARTS.index(name)]
        local, rows, ranks = self.shape
        owner = self.owner
        if name == "layout_range":
            flat = owner[start:start + 2 * local * ranks]
            wide = flat.view(sys.modules["torch"].int64) if self.framework == "torch" else flat.view(np.int64)
            arr = wide.reshape(local, ranks)
        elif name == "recv_count":
            arr = owner[start:start + local]
        else:
            arr = owner[start:start + local * rows].reshape(local, rows)
        if self.framework in ("torch", "cupy"):
            return arr
        from ..arrays import from_cupy

        return from_cupy(arr, self.framework, name=name)


@dataclass(eq=False, slots=True)
class LowLatencyHandle:
    """What low-latency combine needs to send a dispatch's rows home. ``src_info`` [L, R*max] int32 (source token
    index of each received row) and ``layout_range`` [L, R] int64 (begin << 32 | count of each source's block) are
    arrays of the caller's framework, made when first read."""

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_topk: int
    meta: _Meta = field(repr=False)
    buffer_id: int = field(default=0, repr=False)
    pending: list[bool] = field(default_factory=lambda: [False], repr=False)  # its dispatch's hook not yet run

    @property
    def src_info(self) -> Any:
        return self.meta.view("src_info")

    @property
    def layout_range(self) -> Any:
        return self.meta.view("layout_range")

    @property
    def topk_slot(self) -> Any:
        """[L, R*max] int32: the top-k slot k each received row answers (combine's per-(token, k) slot at home);
        epjit.autograd reads it to find the gate weight of a row."""
        return self.meta.view("topk_slot")


class LowLatencyDispatchResult:
    """x [L, R*max, H] float8_e4m3fn or bf16 (rows past recv_count[e] are garbage); x_scales [L, R*max, H/128]
    float32 (uint8 exponents with use_ue8m0), or None for bf16; recv_count [L] int32 (made when first read);
    handle; event; hook (with return_recv_hook: runs the receive half, once)."""

    __slots__ = ("x", "x_scales", "handle", "event", "hook")

    def __init__(self, x: Any, x_scales: Any, handle: LowLatencyHandle, event: Event,
                 hook: Callable[[], None] | None) -> None:
        self.x, self.x_scales, self.handle, self.event, self.hook = x, x_scales, handle, event, hook

    @property
    def recv_count(self) -> Any:
        return self.handle.meta.view("recv_count")

    @property
    def src_info(self) -> Any:
        return self.handle.src_info

    @property
    def layout_range(self) -> Any:
        return self.handle.layout_range


@dataclass(slots=True)
class LowLatencyCombineResult:
    x: Any  # [N, H] bf16
    event: Event
    hook: Callable[[], None] | None


@dataclass(slots=True)
class DispatchInputs:
    """One low_latency_dispatch's arrays, as the kernels take them (epjit.arrays.kernel_array); refilled by each
    call and read during that call only, as epjit.ops.normal's records are."""

    x: Any = None
    topk_idx: Any = None
    cumulative_stats: Any = None  # or None
    wait_stats: Any = None  # int64 [ranks], or None (the wait-stats build's, DeepEP's dispatch_wait_recv_cost_stats)


@dataclass(slots=True)
class CombineInputs:
    """One low_latency_combine's arrays, as the kernels take them (refilled by each call)."""

    y: Any = None
    topk_idx: Any = None
    topk_weights: Any = None
    out: Any = None  # the caller's, or None: allocated by the call
    wait_stats: Any = None  # int64 [ranks], or None (DeepEP's combine_wait_recv_cost_stats)


@dataclass(eq=False)
class DispatchPlan:
    """One shape of low_latency_dispatch, validated: its outputs' allocators and the launch's constant arguments."""

    framework: str
    kind: str  # allocation kind (streams.Outputs): "torch" or "cupy"
    num_tokens: int
    num_topk: int
    fp8: bool
    new_x: Callable[[], Any]
    new_scales: Callable[[], Any] | None
    new_meta: Callable[[], Any]
    meta_offsets: tuple[int, ...]
    meta_shape: tuple[int, int, int]  # local experts, rows, ranks
    shared_bytes: int
    args: jit.KernelArgs  # every argument that is the same call after call


@dataclass(eq=False)
class CombinePlan:
    """One shape of low_latency_combine, validated."""

    framework: str
    kind: str
    num_tokens: int
    new_out: Callable[[], Any]
    args: jit.KernelArgs


class LowLatency:
    """A low-latency Buffer's kernels, device words, status words and the bookkeeping of its two buffer sets."""

    shrink: ShrinkMask | None = None  # shrink mode's mask and reports (set in __init__ where it is on)

    def __init__(self, mem: PeerMemory, streams: Streams, outputs: Outputs, profile: Profile, device: int,
                 num_max_tokens: int, hidden: int, num_experts: int, force_puts: bool, num_sms: int,
                 shrink_timeout_s: float | None = None) -> None:
        """``shrink_timeout_s``: shrink mode (the kernels' shrink build), a peer that does not answer within it
        masked; None: without."""
        cupy = _cupy()
        self.mem, self.streams, self.outputs, self.profile = mem, streams, outputs, profile
        self.device = device
        self.num_ranks = mem.group.size
        self.num_max_tokens, self.hidden, self.num_experts = num_max_tokens, hidden, num_experts
        self.force_puts = int(force_puts)
        self.puts = needs_puts(force_puts, mem.sym)  # the build with a put path: no LogFMT combine there
        shrink = shrink_timeout_s is not None
        self.module = load(kernels_for(force_puts, mem.sym, shrink), device)
        self._wait_stats_module: jit.Module | None = None  # its wait-stats build, loaded by the first call with stats
        with cupy.cuda.Device(device):
            # LowLatencySync + expert_sent (+ shrink mode's words and mask)
            self.sync = cupy.zeros(sync_ints(num_experts, self.num_ranks, shrink), dtype=cupy.int32)
            self.shrink = low_latency_shrink(self.sync, num_experts, self.num_ranks, shrink_timeout_s, mem, streams,
                                               device) if shrink else None
        self.host_status = MappedHostArray(64)  # see the module docstring
        self.status_seen = np.zeros(1 + STATUS_BIT_COUNT, dtype=np.int32)
        self.next_set = 0
        self.pending: list[str | None] = [None, None]  # per set: which call's hook has not run yet
        self.combine_buffers: list[Any] = [None, None]  # get_next_low_latency_combine_buffer, per set
        props = cupy.cuda.runtime.getDeviceProperties(device)
        self.num_sms = min(int(props["multiProcessorCount"]), num_sms or MAX_BLOCKS)
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.host_status.close()
        if self.shrink is not None:
            self.shrink.close()

    # ---------------------------------------------------------------------------------------------------- plans

    def _common_args(self, kernel: str) -> jit.KernelArgs:
        return self.module.spec.args(
            kernel, peers=self.mem.table_ptr, hidden=self.hidden, num_experts=self.num_experts,
            max_tokens=self.num_max_tokens, force_puts=self.force_puts, sync=int(self.sync.data.ptr),
            host_status=self.host_status.device_ptr, timeline=0, wait_stats=0)

    def dispatch_plan(self, framework: str, num_tokens: int, num_topk: int, use_fp8: bool, round_scale: bool,
                      use_ue8m0: bool) -> DispatchPlan:
        """What a dispatch of this shape needs (its arguments already checked by the front)."""
        local, rows, hidden = self.num_experts // self.num_ranks, self.num_ranks * self.num_max_tokens, self.hidden
        flags = (FLAG_FP8 if use_fp8 else 0) | (FLAG_ROUND_SCALE if round_scale else 0) | \
            (FLAG_UE8M0 if use_ue8m0 else 0)
        out, kind = self.outputs, _kind(framework)
        new_x = out.allocator(kind, (local, rows, hidden), out.dtype(kind, "float8_e4m3fn" if use_fp8 else "bfloat16"))
        new_scales = None
        if use_fp8:
            new_scales = out.allocator(kind, (local, rows, hidden // 128),
                                       out.dtype(kind, "uint8" if use_ue8m0 else "float32"))
        offsets = meta_offsets(local, rows, self.num_ranks)
        new_meta = out.allocator(kind, (offsets[-1],), out.dtype(kind, "int32"))
        args = self._common_args("ll_dispatch").set(num_tokens=num_tokens, num_topk=num_topk, flags=flags)
        return DispatchPlan(framework, kind, num_tokens, num_topk, use_fp8, new_x, new_scales,
                            new_meta, offsets, (local, rows, self.num_ranks),
                            dispatch_shared_bytes(hidden, num_tokens, num_topk, self.num_experts, self.num_ranks),
                            args)

    def combine_plan(self, framework: str, num_tokens: int, num_topk: int, use_logfmt: bool) -> CombinePlan:
        kernel = "ll_combine_logfmt" if use_logfmt else "ll_combine"
        args = self._common_args(kernel).set(num_tokens=num_tokens, num_topk=num_topk)
        kind = _kind(framework)
        new_out = self.outputs.allocator(kind, (num_tokens, self.hidden), self.outputs.dtype(kind, "bfloat16"))
        return CombinePlan(framework, kind, num_tokens, new_out, args)

    # ---------------------------------------------------------------------------------------------------- calls

    def dispatch(self, plan: DispatchPlan, inputs: DispatchInputs, buffer_id: int, hook: bool,
                 async_finish: bool) -> LowLatencyDispatchResult:
        """Send each (token, chosen expert) to its slot; with ``hook`` only the send half runs now."""
        stats, waits = inputs.cumulative_stats, inputs.wait_stats  # (None read inline: a call costs more)
        module = self.module if waits is None else self.wait_stats_module(plan.framework)
        s, caller = self._start("dispatch", plan.framework)
        fw, streams = plan.framework, self.streams
        recv_x, owner = plan.new_x(), plan.new_meta()
        recv_scales = plan.new_scales() if plan.new_scales is not None else None
        meta = _Meta(owner, fw, address(owner), plan.meta_offsets, plan.meta_shape)
        ptrs = meta.ptrs
        args = plan.args.copy() if hook else plan.args
        args.set(x=address(inputs.x), topk_idx=address(inputs.topk_idx), set=s,
                 phases=PHASE_SEND if hook else PHASE_SEND | PHASE_RECV, recv_x=address(recv_x),
                 recv_scales=0 if recv_scales is None else address(recv_scales), recv_src_info=ptrs[0],
                 recv_topk_slot=ptrs[1], layout_range=ptrs[2], recv_count=ptrs[3],
                 cumulative_stats=0 if stats is None else address(stats), wait_stats=0 if waits is None else
                 address(waits))
        self._launch_dispatch(plan, args, module)
        event = streams.finish(caller, async_finish)
        if async_finish and plan.kind == "torch":
            streams.used_by_comm((recv_x, recv_scales, owner, inputs.x, inputs.topk_idx, stats, waits))
        handle = LowLatencyHandle(self.num_max_tokens, self.hidden, self.num_experts, plan.num_topk, meta,
                                  buffer_id, [hook])
        run_hook = None
        if hook:
            def done() -> None:
                handle.pending[0] = False

            run_hook = self.hook(s, "dispatch",
                                 lambda: self._launch_dispatch(plan, args.set(phases=PHASE_RECV), module), fw,
                                 async_finish, (inputs.x, inputs.topk_idx, waits), done)
        if fw not in ("torch", "cupy"):
            from ..arrays import from_cupy

            recv_x = from_cupy(recv_x, fw, dtype="float8_e4m3fn" if plan.fp8 else None, name="recv_x")
            recv_scales = from_cupy(recv_scales, fw) if recv_scales is not None else None
        return LowLatencyDispatchResult(recv_x, recv_scales, handle, event, run_hook)

    def _start(self, call: str, framework: str) -> tuple[int, int]:
        """A call's buffer set and its caller's stream, the communication stream ordered after the caller's work."""
        s = self.take_set(call)
        if self.profile.enabled:
            self.profile.start()
        caller = caller_stream(framework, self.device)
        self.streams.begin(caller)
        return s, caller

    def _launch_dispatch(self, plan: DispatchPlan, args: jit.KernelArgs, module: jit.Module) -> None:
        if self.profile.enabled:
            args.set(timeline=self.profile.timeline("ll_dispatch" + _PHASE_SUFFIX[args["phases"]], self.num_sms,
                                                    TIMELINE_POINTS))
        module.launch(args if module is self.module else args.on(module.spec), self.num_sms, LOW_LATENCY_THREADS,
                      shared_mem=plan.shared_bytes, stream=self.streams.comm_ptr)

    def wait_stats_module(self, framework: str) -> jit.Module:
        """The wait-stats build of this Buffer's kernels (EPJIT_LL_WAIT_STATS), loaded by the first call given
        wait-stats arrays: a module load would break a CUDA-graph capture, so that call cannot be captured (refused
        before the call takes a buffer set)."""
        found = self._wait_stats_module
        if found is None:
            if is_capturing(caller_stream(framework, self.device)):
                raise ArgumentError(with_rank(
                    "the first low-latency call given dispatch_wait_recv_cost_stats or combine_wait_recv_cost_stats "
                    "loads the kernels' wait-stats build, which cannot happen inside a CUDA-graph capture: make one "
                    "such call before capturing"))
            found = self._wait_stats_module = load(WAIT_STATS_BUILDS[type(self.module.spec)](), self.device)
        return found

    def combine(self, plan: CombinePlan, inputs: CombineInputs, handle: LowLatencyHandle, hook: bool,
                async_finish: bool) -> LowLatencyCombineResult:
        """Send the expert outputs home and reduce them; with ``hook`` only the send half runs now."""
        waits = inputs.wait_stats
        module = self.module if waits is None else self.wait_stats_module(plan.framework)
        s, caller = self._start("combine", plan.framework)
        fw, streams = plan.framework, self.streams
        y, idx, w, out = inputs.y, inputs.topk_idx, inputs.topk_weights, inputs.out
        if out is None:
            out = plan.new_out()
        ptrs = handle.meta.ptrs
        args = plan.args.copy() if hook else plan.args
        args.set(y=address(y), src_info=ptrs[0], topk_slot=ptrs[1], layout_range=ptrs[2], topk_idx=address(idx),
                 topk_weights=address(w), out=address(out), set=s,
                 phases=PHASE_SEND if hook else PHASE_SEND | PHASE_RECV, wait_stats=0 if waits is None else
                 address(waits))
        self._launch_combine(args, module)
        event = streams.finish(caller, async_finish)
        if async_finish and plan.kind == "torch":
            streams.used_by_comm((out, y, idx, w, waits))
        # The receive half reads topk_idx and topk_weights (by address): the hook holds them until it runs.
        run_hook = self.hook(s, "combine", lambda: self._launch_combine(args.set(phases=PHASE_RECV), module), fw,
                             async_finish, (y, idx, w, handle.meta, waits)) if hook else None
        if fw not in ("torch", "cupy"):
            from ..arrays import from_cupy

            out = from_cupy(out, fw, name="combined_x")
        return LowLatencyCombineResult(out, event, run_hook)

    def _launch_combine(self, args: jit.KernelArgs, module: jit.Module) -> None:
        if self.profile.enabled:
            args.set(timeline=self.profile.timeline(args.kernel + _PHASE_SUFFIX[args["phases"]], self.num_sms,
                                                    TIMELINE_POINTS))
        module.launch(args if module is self.module else args.on(module.spec), self.num_sms, LOW_LATENCY_THREADS,
                      stream=self.streams.comm_ptr)

    # ---------------------------------------------------------------------------------------------------- sets

    def take_set(self, call: str) -> int:
        """The buffer set this call takes; refuses one whose earlier call still waits for its hook."""
        s = self.next_set
        if self.pending[s] is not None:
            raise ArgumentError(with_rank(
                f"low_latency_{call} would reuse buffer set {s}, whose {self.pending[s]} has a receive hook that "
                "has not run: call that hook first (two calls may be in flight at most)"))
        self.next_set ^= 1
        return s

    def hook(self, s: int, call: str, launch: Callable[[], None], framework: str, async_finish: bool, keep: Any,
             then: Callable[[], None] | None = None) -> Callable[[], None]:
        """The receive half as a callable, run on the stream current when it is called (torch's for torch
        callers): so a hook called inside a CUDA-graph capture is captured there. It holds ``keep`` until it
        runs."""
        self.pending[s] = f"low_latency_{call}"
        held = [keep]  # emptied when the hook runs

        def hook() -> None:
            if not held:
                raise ArgumentError(with_rank(f"this low_latency_{call} hook already ran"))
            if self.closed:
                raise EpjitError(with_rank("this Buffer is closed"))
            caller = caller_stream(framework, self.device)
            self.streams.begin(caller)
            launch()
            self.streams.finish(caller, async_finish)
            held.clear()
            self.pending[s] = None
            if then is not None:
                then()

        return hook

    def check_handle(self, handle: Any, buffer_id: int) -> LowLatencyHandle:
        if type(handle) is not LowLatencyHandle or handle.buffer_id != buffer_id:
            raise ArgumentError(with_rank("handle must be the .handle of a low_latency_dispatch of this Buffer"))
        if handle.pending[0]:
            raise ArgumentError(with_rank("the dispatch of this handle has a receive hook that has not run: "
                                          "call its hook() first"))
        return handle

    def next_combine_buffer(self, handle: LowLatencyHandle) -> Any:
        """A [L, R*max, H] bf16 CuPy array for the next combine's expert outputs (two alternate with the sets)."""
        s = self.next_set
        if self.combine_buffers[s] is None:
            import ml_dtypes

            cupy = _cupy()
            with cupy.cuda.Device(self.device):
                shape = (self.num_experts // self.num_ranks, self.num_ranks * handle.num_max_dispatch_tokens_per_rank,
                         handle.hidden)
                self.combine_buffers[s] = cupy.empty(shape, dtype=ml_dtypes.bfloat16)
        return self.combine_buffers[s]

    def is_combine_buffer(self, address: int) -> bool:
        return any(b is not None and b.data.ptr == address for b in self.combine_buffers)

    # ---------------------------------------------------------------------------------------------------- status

    def raise_status(self) -> None:
        """Raise, once, what earlier kernels found (their last block counts it in host_status); a rank a wait
        masked (shrink mode) is a warning and a report, not an error."""
        ints = self.host_status.ints
        if ints[0] == self.status_seen[0]:
            return
        reports = ints[0]  # read first: the kernel releases it after the counts
        counts = ints[1:1 + STATUS_BIT_COUNT].copy()
        raised = counts != self.status_seen[1:]
        self.status_seen[0], self.status_seen[1:] = reports, counts
        status = sum(1 << b for b in range(STATUS_BIT_COUNT) if raised[b])
        if status & STATUS_RANK_MASKED and self.shrink is not None:
            self.shrink.collect()
            status &= ~STATUS_RANK_MASKED
        if status == 0:
            return
        raise ArgumentError(with_rank("an earlier low-latency call was wrong, its results are not valid: "
                                      + "; ".join(self.describe_status(status))))

    def describe_status(self, status: int) -> list[str]:
        problems = []
        if status & STATUS_INVALID_IDS:
            problems.append(f"topk_idx had entries outside [-1, num_experts={self.num_experts}) (skipped)")
        if status & STATUS_SLOT_OVERFLOW:
            problems.append("one rank's topk_idx named one expert in more than "
                            f"num_max_dispatch_tokens_per_rank={self.num_max_tokens} slots "
                            "(repeated experts; the extra rows were dropped)")
        if status & STATUS_META_MISMATCH:
            problems.append("a rank dispatched with another hidden size or use_fp8 setting than this one")
        if status & STATUS_LAYOUT_TOO_BIG:
            problems.append("the kernels' buffer layout does not fit the symmetric heap (an epjit bug: "
                            "epjit/kernels/low_latency.py and cuda_src/low_latency.cuh disagree)")
        if status & STATUS_RANK_MASKED:
            problems.append("a wait on a peer timed out and masked it")
        return problems

    def clean(self) -> None:
        """Forget every call (epochs, signals, pending hooks, status). The caller synchronised every rank; no
        low-latency work is in flight."""
        cupy = _cupy()
        with cupy.cuda.Device(self.device):
            self.sync.fill(0)
            heap = self.mem.sym
            assert heap is not None
            cupy.cuda.runtime.memset(heap.base, 0, low_latency_size_hint(
                self.num_max_tokens, self.hidden, self.num_ranks, self.num_experts))
            cupy.cuda.runtime.deviceSynchronize()
        self._forget()

    def _forget(self) -> None:
        self.host_status.ints[:] = 0  # no kernel runs: the caller synchronised
        self.status_seen[:] = 0
        self.next_set = 0
        self.pending = [None, None]

    # ---------------------------------------------------------------------------------------------------- shrink

    def clean_live(self) -> None:
        """Shrink mode's clean: the device barrier of the live ranks (ll_clean_barrier, a rank that does not come
        masked), this rank's two sets and call words zeroed, the barrier again; the mask and the clean words kept.
        No host collective, so a dead rank cannot hang it. No low-latency work of this rank is in flight."""
        cupy, shrink = _cupy(), self.shrink
        assert shrink is not None and self.mem.sym is not None
        args = self.module.spec.args("ll_clean_barrier", peers=self.mem.table_ptr, sync=int(self.sync.data.ptr),
                                     num_experts=self.num_experts, max_tokens=self.num_max_tokens, hidden=self.hidden,
                                     force_puts=self.force_puts)
        comm = self.streams.comm
        with cupy.cuda.Device(self.device):
            self.module.launch(args.set(round=2 * shrink.cleans + 1), 1, LOW_LATENCY_THREADS,
                               stream=self.streams.comm_ptr)
            with comm:
                self.sync[:SYNC_BYTES // 4 + self.num_experts].fill(0)  # (not the mask after them)
            sets = clean_words_offset(self.num_ranks, self.num_experts, self.num_max_tokens, self.hidden)
            cupy.cuda.runtime.memsetAsync(self.mem.sym.base, 0, sets, self.streams.comm_ptr)
            self.module.launch(args.set(round=2 * shrink.cleans + 2), 1, LOW_LATENCY_THREADS,
                               stream=self.streams.comm_ptr)
            shrink.cleans += 1
            self.mem.synchronize(comm)
        self._forget()
        shrink.collect()


__all__ = ["FLAG_FP8", "FLAG_ROUND_SCALE", "FLAG_UE8M0", "MAX_BLOCKS", "PHASE_RECV", "PHASE_SEND",
           "STATUS_BIT_COUNT", "STATUS_INVALID_IDS", "STATUS_LAYOUT_TOO_BIG", "STATUS_META_MISMATCH",
           "STATUS_RANK_MASKED", "STATUS_SLOT_OVERFLOW", "LowLatency", "LowLatencyCombineResult",
           "LowLatencyDispatchResult", "LowLatencyHandle", "needs_puts"]
