"""Normal mode inside one NVLink node (cuda_src/intranode.cu): notify, dispatch through per-channel rings into
exactly-sized outputs, and combine by the dispatch's receipts.

This module owns the family's protocol constants and status bits, the host records notify fills (their pool, the
record of CUDA-graph replays, and the worst-token calls not yet reported), the estimate that sizes outputs before
the counts are known, the handles and results, and the launches. Validation is the Buffer's: what reaches here is
a plan (what one shape of a call needs, built once) and the call's arrays.

A notify host record (mapped host memory, int32; docs/layouts.md):

    [0] rows this rank receives (-1 until notify writes it, last, with a system-scope release)
    [1] status bits (0: accepted)
    [2 .. 2 + 8R)  every rank's meta: hidden, num_experts, num_topk, flags, recv_capacity, 0, 0, 0
    [.. + R)       rows each rank receives
    [.. + E/R)     tokens received per local expert (rounded up to expert_alignment)
"""

from __future__ import annotations

import collections
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .. import jit
from ..config import Config
from ..errors import ArgumentError, EpjitError, with_rank
from ..kernels.intranode import (
    CLAIMS_INTS,
    META_INTS,
    NOTIFY_TIMELINE_POINTS,
    NUM_THREADS,
    TIMELINE_POINTS,
    IntranodeNotifySpec,
    IntranodeSpec,
    normal_grid,
)
from ..memory import MappedHostArray, PeerMemory
from .layout import MadeLayout
from .loader import load
from .profile import Profile
from .streams import POISON_BYTE, Event, Outputs, Streams, caller_stream, is_capturing

# Status bits of notify (kStatus* in cuda_src/status.cuh): why every rank refused a call.
STATUS_META_MISMATCH, STATUS_WORST_TOO_SMALL, STATUS_LAYOUT_TOO_BIG, STATUS_INVALID_IDS = 1, 2, 4, 8
STATUS_OVER_CAPACITY = 16  # some rank's rows do not fit the outputs allocated for them
# Flags each rank announces in its meta (kFlag*), and meta bits a rank sets about itself (kMeta*).
FLAG_FP8, FLAG_WEIGHTS, FLAG_TOPK, FLAG_WORST_TOKENS, FLAG_CAPTURED = 1, 2, 4, 8, 16
META_INVALID_IDS, META_LAYOUT_TOO_BIG = 1 << 29, 1 << 30
OWN_META_BITS = META_INVALID_IDS | META_LAYOUT_TOO_BIG | FLAG_WORST_TOKENS | FLAG_CAPTURED  # need not agree
META_NAMES = ("hidden", "num_experts", "num_topk", "flags")  # the meta every rank must agree on, in order
# Host records a dispatch after dispatch may leave in flight: each call gets its own, round robin, because a
# worst-token dispatch does not wait for its record (it is read once the call's event is done) and the host runs
# ahead of the GPU. A record comes round again only after the call that last wrote it has been reported, so a
# later call can neither overwrite an unreported refusal nor take an earlier call's counts for its own; a host this
# many calls ahead waits for the oldest.
HOST_RECORDS = 64
HOST_RECORD_BYTES = 4096  # a record's least size and its share of the pool (more experts: a record of its own)
RATE_HISTORY = 32  # dispatches whose received rows per token size the next one's outputs (RowEstimate)


def expert_counts_at(num_ranks: int, forwarded: bool = False) -> int:
    """Where the host record's rows per local expert start: after [0] rows, [1] status, the metas and the totals
    (and, across nodes, the tokens each rank forwards)."""
    return 2 + (META_INTS + (2 if forwarded else 1)) * num_ranks


def host_record_bytes(num_ranks: int, num_experts: int, forwarded: bool = False) -> int:
    return max(4 * (expert_counts_at(num_ranks, forwarded) + num_experts // num_ranks), HOST_RECORD_BYTES)


def call_flags(fp8: bool, with_weights: bool, with_idx: bool, num_worst_tokens: int) -> int:
    """The flags a rank announces in its meta for a dispatch of this kind (kFlag*)."""
    return (FLAG_FP8 if fp8 else 0) | (FLAG_WEIGHTS if with_weights else 0) | (FLAG_TOPK if with_idx else 0) | \
        (FLAG_WORST_TOKENS if num_worst_tokens > 0 else 0)


def describe_meta(name: str, value: int) -> str:
    if name != "flags":
        return str(value)
    return "/".join([("FP8" if value & FLAG_FP8 else "bf16"), ("weights" if value & FLAG_WEIGHTS else "no weights"),
                     ("topk_idx" if value & FLAG_TOPK else "no topk_idx")])


def refusal(ints: np.ndarray, num_ranks: int, num_nvl_bytes: int, num_worst_tokens: int,
            replayed: bool = False, forwarded: bool = False) -> ArgumentError | None:
    """What a notify record says was refused, as the error to raise (None when its status is 0). ``forwarded``: an
    internode record, whose metas also carry the forwarded-token capacity and a config tag, and whose totals are
    followed by the tokens each rank forwards."""
    status = int(ints[1])
    if status == 0:
        return None
    r = num_ranks
    meta = ints[2:2 + META_INTS * r].reshape(r, META_INTS).copy()
    totals = ints[2 + META_INTS * r:2 + (META_INTS + 1) * r].copy()
    problems = []
    if status & STATUS_LAYOUT_TOO_BIG:
        buffers = "num_nvl_bytes / num_rdma_bytes" if forwarded else f"num_nvl_bytes={num_nvl_bytes}"
        problems.append(f"the call's rings do not fit {buffers} on some rank (a larger Buffer or a smaller Config: "
                        "chunk sizes / num_sms)")
    if status & STATUS_INVALID_IDS:
        ranks = [i for i in range(r) if meta[i, 3] & META_INVALID_IDS]
        problems.append(f"topk_idx has entries outside [-1, num_experts={int(meta[ranks[0], 1])}) on rank(s) "
                        f"{', '.join(map(str, ranks))}")
    if status & STATUS_META_MISMATCH:
        compared = list(enumerate(META_NAMES)) + ([(7, "config")] if forwarded else [])
        for j, name in compared:
            column = meta[:, j] & ~OWN_META_BITS if name == "flags" else meta[:, j]
            if len(set(column.tolist())) > 1:
                values = ", ".join(f"rank {i}: {describe_meta(name, int(v))}" for i, v in enumerate(column))
                problems.append(f"{name} differs across ranks: {values}")
    capacities = [("rows received", totals, 4)]
    if forwarded:
        capacities.append(("tokens forwarded", ints[2 + (META_INTS + 1) * r:2 + (META_INTS + 2) * r].copy(), 5))
    if status & STATUS_WORST_TOO_SMALL:
        for what, counts, column in capacities:
            values = ", ".join(f"rank {i}: {int(v)} for {int(meta[i, column])}" for i, v in enumerate(counts)
                               if meta[i, 3] & FLAG_WORST_TOKENS and v > meta[i, column])
            if values:
                problems.append(f"num_worst_tokens={num_worst_tokens} is too small for what arrives ({what} for "
                                f"num_worst_tokens: {values})")
    if status & STATUS_OVER_CAPACITY and not problems:
        values = "; ".join(f"{what}: " + ", ".join(f"rank {i}: {int(v)} for {int(meta[i, column])}"
                                                   for i, v in enumerate(counts) if meta[i, column] < v)
                           for what, counts, column in capacities if (meta[:, column] < counts).any())
        problems.append(f"the routing does not match the handle's ({values})")
    what = "a dispatch replayed from a CUDA graph was" if replayed else "dispatch"
    return ArgumentError(with_rank(f"{what} refused on every rank: " + "; ".join(problems)))


class _Pending(NamedTuple):
    call: int
    event: Any  # a cupy.cuda.Event recorded on the communication stream after the call
    record: MappedHostArray
    num_worst_tokens: int


class HostRecords:
    """The mapped host records notify fills: a pool of HOST_RECORDS taken round robin, the record of every dispatch
    captured in a CUDA graph (replays write it whenever they run; the host reads it only when its status is set),
    and the worst-token calls whose record is not read yet, oldest first."""

    def __init__(self, rank: int, num_ranks: int, num_nvl_bytes: int, graph_experts: int,
                 raise_for: Callable[[BaseException], None], forwarded: bool = False) -> None:
        self.rank, self.num_ranks, self.num_nvl_bytes = rank, num_ranks, num_nvl_bytes
        self.forwarded = forwarded  # internode records (refusal's forwarded)
        self.raise_for = raise_for  # turns a CUDA error met while waiting into the error to raise
        self.records: list[MappedHostArray | None] = [None] * HOST_RECORDS
        self.calls = [-1] * HOST_RECORDS  # the dispatch (numbered from 0) that last used each record
        self.num_calls = 0
        self.pending: collections.deque[_Pending] = collections.deque()
        self.pool: MappedHostArray | None = None
        # Made now: pinned memory cannot be allocated during a capture. One cudaHostAlloc for the pool.
        self.graph = MappedHostArray(host_record_bytes(num_ranks, max(graph_experts, 4096), forwarded))
        try:
            self.pool = MappedHostArray(HOST_RECORDS * HOST_RECORD_BYTES)
        except BaseException:
            self.graph.close()
            raise
        self.records[:] = self.pool.parts(HOST_RECORD_BYTES)

    def take(self, num_experts: int, captured: bool) -> tuple[MappedHostArray, int]:
        """The record notify fills for this dispatch, and the call's number (-1 for a captured one)."""
        need = host_record_bytes(self.num_ranks, num_experts, self.forwarded)
        if captured:
            if need > self.graph.num_bytes:
                raise ArgumentError(with_rank(f"a dispatch captured in a CUDA graph takes up to 4096 experts (or the "
                                              f"Buffer's num_experts), got {num_experts}"))
            return self.graph, -1
        call, i = self.num_calls, self.num_calls % HOST_RECORDS
        self.num_calls += 1
        while self.pending and self.pending[0].call <= self.calls[i]:
            self.report_oldest()  # the record's last writer first (waiting for it, if the host ran this far ahead)
        self.calls[i] = call
        record = self.records[i]
        if record is None or record.num_bytes < need:
            if record is not None:
                record.close()  # its call is over: it waited for its counts, or was just reported
            record = self.records[i] = MappedHostArray(need)
        return record, call

    def add_pending(self, call: int, event: Any, record: MappedHostArray, num_worst_tokens: int) -> None:
        self.pending.append(_Pending(call, event, record, num_worst_tokens))

    def check(self, capturing: Callable[[], bool]) -> None:
        """Raise what earlier worst-token dispatches' notify found, oldest first, for those their stream got past,
        and what a replayed graph's notify refused since the last look (not while the caller captures a graph)."""
        graph = self.graph
        graph_refused = graph.ints[1] != 0
        if not (self.pending or graph_refused) or capturing():  # the common case asks the stream nothing
            return
        while self.pending and self.pending[0].event.done:
            self.report_oldest()
        if graph_refused:
            seen = graph.ints.copy()
            graph.ints[1] = 0
            me = self.rank % self.num_ranks
            error = refusal(seen, self.num_ranks, self.num_nvl_bytes, int(seen[2 + META_INTS * me + 4]), True,
                            self.forwarded)
            if error is not None:
                raise error

    def report_oldest(self) -> None:
        """Wait for the oldest unreported worst-token dispatch and raise what its notify found (once)."""
        pending = self.pending.popleft()
        try:
            pending.event.synchronize()
        except Exception as e:
            if type(e).__name__ == "CUDARuntimeError":  # a kernel trapped (a timed-out wait): say what it waited for
                self.raise_for(e)
            raise
        error = refusal(pending.record.ints, self.num_ranks, self.num_nvl_bytes, pending.num_worst_tokens,
                        forwarded=self.forwarded)
        if error is not None:
            raise error

    def close(self) -> None:
        for record in (*self.records, self.graph, self.pool):
            if record is not None:
                record.close()  # a pooled record's does nothing; the pool's, last, frees them all


class RowEstimate:
    """Rows of dispatch output to allocate before the counts are known: R x N the first time (every token to every
    rank; more arrive only when other ranks send more tokens than this one), then the most rows per token of the
    last RATE_HISTORY calls, times N, plus 1/16 and 128 rows. The most, not the last: one Buffer serves every MoE
    layer of a model, each with its own routing balance, and a call that does not fit costs a second notify (notify
    stops it on every rank and it runs again with the exact rows).

    At most twice the most rows of those calls, plus 128: what a rank receives is what the others send, so a call
    in which this rank sent 1 token and received 1,000 rows (a rate of 1,000) says nothing about a call of 512
    tokens, for which the rate alone would allocate half a million rows (gigabytes at hidden 4096). A call that
    outgrows the bound twofold (a prefill after decode steps) runs twice once, and is part of the bound after."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.rates: collections.deque[float] = collections.deque(maxlen=RATE_HISTORY)
        self.recent_rows: collections.deque[int] = collections.deque(maxlen=RATE_HISTORY)
        self.retries = 0  # dispatches run again because their outputs were too small (tests read it)

    def rows(self, num_tokens: int) -> int:
        if not self.recent_rows:
            return self.num_ranks * num_tokens
        by_rate = int(max(self.rates, default=0.0) * num_tokens * 17 / 16) + 128
        return min(by_rate, 2 * max(self.recent_rows) + 128)

    def saw(self, num_tokens: int, num_rows: int) -> None:
        self.recent_rows.append(num_rows)
        if num_tokens > 0:
            self.rates.append(num_rows / num_tokens)


class Ints(NamedTuple):
    """An int32 array inside a larger CuPy allocation (dispatch makes one a call for all of them): the address the
    kernels take, and the owner that keeps the memory alive. Its CuPy view is made only when someone asks."""

    owner: Any  # 1-D int32 CuPy array
    offset: int  # in elements
    shape: tuple[int, ...]
    ptr: int

    def view(self, rows: int | None = None) -> Any:
        shape = self.shape if rows is None else (rows, *self.shape[1:])
        n = math.prod(shape)
        return self.owner[self.offset:self.offset + n].reshape(shape)


@dataclass(eq=False, slots=True)
class DispatchHandle:
    """Everything combine (and a cached dispatch) needs to replay a routing: the dispatch's int arrays (CuPy, on this
    GPU, one allocation; their views are made when read), is_token_in_rank, the rows, and the dispatch's plan (its
    sizes)."""

    # rank_prefix_matrix [R, R] ([i, j] = tokens ranks 0..i send to rank j), channel_prefix_matrix [R, C] (tokens of
    # my channels 0..c bound for rank r), recv_channel_offset [R, C] (first received row of (source rank, channel)),
    # send_head [N, R] (ring index token t took towards r, or -(next index)-1), recv_src_idx [rows or more] (source
    # token index of each received row), and the status word [1]: what notify found (0: nothing); the dispatch and
    # every combine of this handle do nothing unless 0, so a handle from a refused worst-token dispatch, used before
    # the refusal is raised, cannot send garbage receipts.
    ints: tuple[Ints, ...] = field(repr=False)
    in_rank_ptr: int = field(repr=False)  # is_token_in_rank [N, R] bool that the dispatch read
    in_rank_owner: Any = field(repr=False)  # what keeps it alive: the layout's allocation or the caller's array
    num_recv_tokens: int  # -1 when unknown to the host (worst-token mode)
    num_rows: int  # rows of the dispatched arrays
    plan: DispatchPlan = field(repr=False)
    buffer_id: int = field(default=0, repr=False)

    # The dispatch's sizes, from its plan, and its int arrays by name.
    num_tokens, hidden, num_topk, num_channels, num_experts = (
        property(operator.attrgetter(f"plan.{name}")) for name in ("num_tokens", "hidden", "num_topk",
                                                                   "num_channels", "num_experts"))
    rank_prefix_ints, channel_prefix_ints, recv_channel_offset_ints, send_head_ints, recv_src_ints, status_ints = (
        property(lambda self, i=i: self.ints[i]) for i in range(6))

    # CuPy views, made when read (a dispatch's host time is what a small batch waits for).
    rank_prefix_matrix, channel_prefix_matrix, recv_channel_offset, send_head = (
        property(lambda self, i=i: self.ints[i].view()) for i in range(4))

    @property
    def recv_src_idx(self) -> Any:
        return self.ints[4].view(self.num_rows)

    @property
    def is_token_in_rank(self) -> Any:
        owner = self.in_rank_owner
        if isinstance(owner, MadeLayout):
            return owner.view(3)
        return owner


@dataclass(slots=True)
class DispatchResult:
    x: Any
    x_scales: Any
    topk_idx: Any
    topk_weights: Any
    num_recv_tokens_per_expert: list[int]
    handle: DispatchHandle
    event: Event


@dataclass(slots=True)
class CombineResult:
    x: Any
    topk_weights: Any
    event: Event


class DispatchInputs(NamedTuple):
    """One dispatch's arrays (kept referenced while the kernels may read them) and their kernel arguments."""

    x: Any  # the array, or the (x_fp8, scales) pair
    x_arg: Any
    scales_arg: Any
    topk_idx: Any
    idx_arg: Any
    topk_weights: Any
    weights_arg: Any


class LayoutInputs(NamedTuple):
    """A layout's kernel arguments (addresses or CuPy arrays) and what keeps is_token_in_rank alive."""

    per_rank: Any
    per_expert: Any
    in_rank: Any
    in_rank_owner: Any
    invalid: int
    keep: tuple[Any, ...]  # arrays an async torch call must mark as used on the communication stream
    per_node: Any = 0  # num_tokens_per_rdma_rank, across nodes


@dataclass(eq=False)
class DispatchPlan:
    """One shape of dispatch, validated: sizes, the outputs to allocate and both launches' constant arguments."""

    framework: str
    kind: str  # allocation kind (streams.Outputs)
    num_tokens: int
    hidden: int
    num_topk: int
    num_scales: int
    num_experts: int
    fp8: bool
    with_idx: bool
    with_weights: bool
    num_worst_tokens: int
    num_channels: int
    flags: int
    # allocators of recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights by rows (None: not an output)
    new_outputs: tuple[Callable[[int], Any] | None, ...]
    output_cols: tuple[int, ...]  # the outputs' columns, in the same order
    record_ints: int  # the host record's head, totals and (without a handle) received tokens per local expert
    notify_args: jit.KernelArgs
    dispatch_args: jit.KernelArgs
    module: jit.Module


@dataclass(eq=False)
class CombinePlan:
    """One shape of combine, validated: its outputs' allocators, grid and constant arguments."""

    framework: str
    kind: str
    new_out: Callable[[], Any]
    new_out_weights: Callable[[], Any] | None  # None: the call combines no weights
    grid: int
    args: jit.KernelArgs
    module: jit.Module


class Intranode:
    """Normal mode of a Buffer inside one NVLink node: its kernels, channel claims, host records and estimates."""

    def __init__(self, mem: PeerMemory, streams: Streams, outputs: Outputs, profile: Profile, device: int,
                 num_experts: int) -> None:
        import cupy

        self.mem, self.streams, self.outputs, self.profile = mem, streams, outputs, profile
        self.device = device
        self.num_ranks = mem.group.size
        self.num_nvl_bytes = mem.nvl.num_bytes if mem.nvl is not None else 0
        self.notify_module = load(self._notify_spec(), device)
        self._modules: dict[Any, jit.Module] = {}
        self.records = HostRecords(mem.group.rank, self.num_ranks, self.num_nvl_bytes, num_experts, mem.raise_for,
                                   self.FORWARDED)
        self.estimate = RowEstimate(self.num_ranks)
        try:
            with cupy.cuda.Device(device):
                # cuda_src/placement.cuh's ChannelClaims for dispatch, then for combine: zero before the first
                # launch; each launch's last block zeroes them for the next.
                self._claims = cupy.zeros(2 * CLAIMS_INTS, dtype=cupy.int32)
                self.num_device_sms = int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
        except BaseException:
            self.records.close()
            raise
        base = int(self._claims.data.ptr)
        self.claims = (base, base + 4 * CLAIMS_INTS)

    FORWARDED = False  # whether notify's records count forwarded tokens (the internode family's do)

    def _notify_spec(self) -> Any:
        return IntranodeNotifySpec(self.num_ranks)

    def module(self, spec: Any) -> jit.Module:
        """The dispatch/combine module of these warp roles (loaded on first use)."""
        found = self._modules.get(spec)
        if found is None:
            found = self._modules[spec] = load(spec, self.device)
        return found

    def close(self) -> None:
        self.records.close()

    def check_pending(self, capturing: Callable[[], bool]) -> None:
        self.records.check(capturing)

    # ---------------------------------------------------------------------------------------------------- plans

    def dispatch_plan(self, framework: str, kind: str, spec: IntranodeSpec, config: Config, num_tokens: int,
                      hidden: int, num_topk: int, fp8: bool, with_weights: bool, with_idx: bool, num_experts: int,
                      num_worst_tokens: int, expert_alignment: int, cached: bool) -> DispatchPlan:
        """What a dispatch of this shape needs (its arguments already checked by the Buffer)."""
        num_scales = hidden // 128 if fp8 else 0
        flags = call_flags(fp8, with_weights, with_idx, num_worst_tokens)
        module = self.module(spec)
        channels = config.num_channels
        table = self.mem.table_ptr
        notify = self.notify_module.spec.args(
            "intranode_notify", peers=table, num_tokens=num_tokens, num_channels=channels,
            num_slots=config.nvl_chunk_recv, hidden=hidden, num_topk=num_topk, num_scales=num_scales,
            num_experts=num_experts, expert_alignment=expert_alignment, cached=int(cached))
        dispatch = module.spec.args(
            "intranode_dispatch", peers=table, claims=self.claims[0], num_tokens=num_tokens, hidden=hidden,
            x_row_int4=hidden * (1 if fp8 else 2) // 16, num_scales=num_scales, num_topk=num_topk,
            num_experts=num_experts, num_channels=channels, num_slots=config.nvl_chunk_recv,
            num_max_send_tokens=config.nvl_chunk_send, num_worst_tokens=num_worst_tokens)
        new_outputs = self._new_outputs(kind, hidden, num_scales, num_topk, fp8, with_idx, with_weights)
        return DispatchPlan(framework, kind, num_tokens, hidden, num_topk, num_scales, num_experts, fp8, with_idx,
                            with_weights, num_worst_tokens, channels, flags, new_outputs,
                            (hidden, num_scales, num_topk, num_topk),
                            expert_counts_at(self.num_ranks) + (0 if cached else num_experts // self.num_ranks),
                            notify, dispatch, module)

    def _new_outputs(self, kind: str, hidden: int, num_scales: int, num_topk: int, fp8: bool, with_idx: bool,
                     with_weights: bool) -> tuple[Callable[[int], Any] | None, ...]:
        """Allocators by rows of recv_x, recv_x_scales, recv_topk_idx and recv_topk_weights (None: not an output)."""
        out = self.outputs
        return (out.row_allocator(kind, hidden, out.dtype(kind, "float8_e4m3fn" if fp8 else "bfloat16")),
                out.row_allocator(kind, num_scales, out.dtype(kind, "float32")) if fp8 else None,
                out.row_allocator(kind, num_topk, out.dtype(kind, "int64")) if with_idx else None,
                out.row_allocator(kind, num_topk, out.dtype(kind, "float32")) if with_weights else None)

    def combine_plan(self, framework: str, kind: str, spec: IntranodeSpec, config: Config, handle: DispatchHandle,
                     with_weights: bool) -> CombinePlan:
        module = self.module(spec)
        args = module.spec.args(
            "intranode_combine", peers=self.mem.table_ptr, claims=self.claims[1], num_tokens=handle.num_tokens,
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
        with self.streams.comm:
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
        dispatch.set(x=inputs.x_arg, x_scales=inputs.scales_arg, topk_idx=inputs.idx_arg,
                     topk_weights=inputs.weights_arg, is_token_in_rank=in_rank)
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
                x = inputs.x if isinstance(inputs.x, (tuple, list)) else (inputs.x,)
                streams.used_by_comm((*outs, *x, inputs.topk_idx, inputs.topk_weights,
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
        profile, comm, address, kind = self.profile, self.streams.comm_ptr, self.outputs.address, plan.kind
        rank_prefix, channel_prefix, recv_channel_offset, send_head, recv_src, status = ints
        notify = plan.notify_args.set(
            recv_capacity=capacity[0], rank_prefix_matrix=rank_prefix.ptr, channel_prefix_matrix=channel_prefix.ptr,
            call_status=status.ptr, timeline=profile.timeline("notify", 1 + self.num_ranks, NOTIFY_TIMELINE_POINTS))
        self.notify_module.launch(notify, 1 + self.num_ranks, 128, stream=comm)
        profile.mark("notify", self.streams.comm)
        dispatch = plan.dispatch_args.set(
            channel_prefix_matrix=channel_prefix.ptr, rank_prefix_matrix=rank_prefix.ptr, call_status=status.ptr,
            recv_x=address(kind, outs[0]), recv_x_scales=address(kind, outs[1]), recv_src_idx=recv_src.ptr,
            recv_topk_idx=address(kind, outs[2]), recv_topk_weights=address(kind, outs[3]),
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

    def combine(self, plan: CombinePlan, handle: DispatchHandle, y: Any, y_arg: Any, weights: Any, weights_arg: Any,
                biases: tuple[Any, ...], bias_args: tuple[Any, Any], previous_event: Event | None,
                async_finish: bool) -> CombineResult:
        """For each original token, the sum of the rows the ranks send back for it (+ bias): dispatch's adjoint."""
        profile, streams, torch_kind = self.profile, self.streams, plan.kind == "torch"
        caller = caller_stream(plan.framework, self.device)
        streams.begin(caller, previous_event)
        out = plan.new_out()
        out_w = plan.new_out_weights() if plan.new_out_weights is not None else None
        if torch_kind:
            out_ptr, out_w_ptr = out.data_ptr(), out_w.data_ptr() if out_w is not None else 0
        else:
            out_ptr, out_w_ptr = out.data.ptr, out_w.data.ptr if out_w is not None else 0
        args = plan.args.set(y=y_arg, y_topk_weights=weights_arg, bias0=bias_args[0], bias1=bias_args[1],
                             out_x=out_ptr, out_topk_weights=out_w_ptr, **self._handle_args(handle))
        if profile.enabled:
            profile.start()
            profile.mark("validated", streams.comm)
            if "timeline" in args.spec.KERNELS[args.kernel][-1]:  # (the internode kernels stamp no timeline)
                args.set(timeline=profile.timeline("combine", plan.grid, TIMELINE_POINTS))
        plan.module.launch(args, plan.grid, NUM_THREADS, stream=streams.comm_ptr)
        if profile.enabled:
            profile.mark("combine", streams.comm)
        event = streams.finish(caller, async_finish)
        if torch_kind:
            if async_finish:
                streams.used_by_comm((out, out_w, y, weights, *biases))
        elif plan.framework != "cupy":
            out, out_w = _hand_over((out, out_w), plan.framework, caller, False)
        result = CombineResult(out, out_w, event)
        if profile.enabled:
            profile.mark("returned")
        return result


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
