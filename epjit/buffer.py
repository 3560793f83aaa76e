"""Buffer: the user API of epjit (normal mode inside one NVLink node).

A Buffer owns the peer memory (CUDA IPC NVLink buffers, optionally the NVSHMEM heap), a communication stream and
the kernels. Every call validates its arguments on every rank before any kernel runs; arguments that must agree
across ranks (hidden, num_experts, top-k, FP8 or not) are compared inside the notify step, so a mismatch raises on
every rank instead of hanging one.

Streams: work is ordered after the caller's current CuPy stream (the DLPack exchange in ``epjit.arrays`` orders
torch's and JAX's streams with it), or after ``previous_event``; it runs on the Buffer's communication stream and
ends with an :class:`Event`. Unless ``async_finish=True`` the caller's stream waits for that event before the call
returns, so results are ready for whatever the caller runs next on it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from . import arrays, jit
from .config import MAX_CHANNELS, Config, get_combine_config, get_dispatch_config, normal_size_hint
from .env import settings
from .errors import ArgumentError, ArgumentTypeError, EpjitError, SetupError, with_rank
from .group import Group
from .kernels import IntranodeNotifySpec, IntranodeSpec, LayoutSpec
from .kernels.foundation import TIMELINE_SLOTS, TIMELINE_SM_SLOT, TIMELINE_TAG_SLOT
from .kernels.intranode import (
    CLAIMS_INTS,
    META_INTS,
    NOTIFY_TIMELINE_POINTS,
    NUM_THREADS,
    configured_intranode_spec,
    intranode_min_nvl_bytes,
    normal_grid,
)
from .kernels.intranode import TIMELINE_POINTS as NORMAL_TIMELINE_POINTS
from .kernels.low_latency import (
    FLAG_FP8,
    FLAG_ROUND_SCALE,
    FLAG_UE8M0,
    LOW_LATENCY_MAX_TOPK,
    LOW_LATENCY_THREADS,
    MAX_DYNAMIC_SHARED_BYTES,
    PHASE_RECV,
    PHASE_SEND,
    STATUS_BIT_COUNT,
    STATUS_INVALID_IDS,
    STATUS_LAYOUT_TOO_BIG,
    STATUS_META_MISMATCH,
    STATUS_SLOT_OVERFLOW,
    SYNC_BYTES,
    LowLatencyPutsSpec,
    LowLatencySpec,
    dispatch_shared_bytes,
    low_latency_size_hint,
)
from .kernels.low_latency import TIMELINE_POINTS as LL_TIMELINE_POINTS
from .memory import MappedHostArray, PeerMemory, SymmetricHeap

# Bits of the notify status (cuda_src/intranode.cu) and of the meta flags each rank announces.
_STATUS_META_MISMATCH, _STATUS_WORST_TOO_SMALL, _STATUS_LAYOUT_TOO_BIG, _STATUS_INVALID_IDS = 1, 2, 4, 8
_STATUS_OVER_CAPACITY = 16
_META_INVALID_IDS, _META_LAYOUT_TOO_BIG = 1 << 29, 1 << 30
_FLAG_FP8, _FLAG_WEIGHTS, _FLAG_TOPK, _FLAG_WORST_TOKENS, _FLAG_CAPTURED = 1, 2, 4, 8, 16
# kOwnMetaBits: need not agree across ranks
_OWN_META_BITS = _META_INVALID_IDS | _META_LAYOUT_TOO_BIG | _FLAG_WORST_TOKENS | _FLAG_CAPTURED
_META_NAMES = ("hidden", "num_experts", "num_topk", "flags")
_RATE_HISTORY = 32  # dispatches whose received rows per token size the next one's outputs (_recv_rows_estimate)
# Notify's host records (received rows, status, meta, per-expert counts) a dispatch after dispatch may leave in
# flight: each call gets its own, round robin, because a worst-token dispatch does not wait for its record (it is
# read once the call's event is done) and the host runs ahead of the GPU. A record comes round again only after
# the call that last wrote it has been reported, so a later call can neither overwrite an unreported refusal nor
# take an earlier call's counts for its own; a host this many calls ahead waits for the oldest.
_HOST_RECORDS = 64
_HOST_RECORD_BYTES = 4096  # a record's least size and its share of the pool (more experts: a record of its own)
_POISON_BYTE = 0x7F  # NaN in bf16 pairs (0x7F7F), NaN in e4m3, a huge int: never a plausible value


def _cupy() -> Any:
    import cupy

    return cupy


_NO_STREAM_CHANGE = contextlib.nullcontext()
_STREAMS: dict[tuple[int, int], Any] = {}  # (torch stream address, device) -> CuPy stream object for it


def _callers_stream(obj: Any) -> Any:
    """A context that makes CuPy's current stream the caller's: torch's current stream for torch tensors on a GPU
    (so a call inside a torch side stream or a torch CUDA-graph capture is ordered, and captured, where the
    caller's work is; torch tensors then reach the kernels by address, with no DLPack stream handshake, because
    this is the stream they are used on); CuPy's own current stream otherwise (JAX and CuPy callers)."""
    if isinstance(obj, (tuple, list)) and obj:
        obj = obj[0]
    if not type(obj).__module__.startswith("torch") or not getattr(obj, "is_cuda", False):
        return _NO_STREAM_CHANGE
    torch = sys.modules["torch"]
    device = torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the address, without a torch.cuda.Stream object
    ptr = raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
    stream = _STREAMS.get((ptr, device))
    if stream is None:
        if len(_STREAMS) >= 64:  # streams come and go; the objects only wrap addresses
            _STREAMS.clear()
        stream = arrays.cupy_stream(ptr, device)  # address 0, torch's legacy default stream, is CuPy's null
        _STREAMS[(ptr, device)] = stream
    return stream


_F = TypeVar("_F", bound=Callable[..., Any])


def _on_callers_stream(method: _F) -> _F:
    """Run a Buffer method on the stream of the caller of its first array argument (see _callers_stream)."""
    first_name = method.__code__.co_varnames[1]

    @functools.wraps(method)
    def wrapper(self: Buffer, *args: Any, **kwargs: Any) -> Any:
        with _callers_stream(args[0] if args else kwargs.get(first_name)):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _capturing() -> bool:
    return bool(_cupy().cuda.get_current_stream().is_capturing())


def _address(arr: Any) -> int:
    """Device address of a torch tensor or CuPy array (0 for None)."""
    if arr is None:
        return 0
    data_ptr = getattr(arr, "data_ptr", None)  # torch
    return data_ptr() if data_ptr is not None else arr.data.ptr


def _arg_address(arg: Any) -> int:
    """Device address of a kernel argument: an int (already one, from arrays.kernel_arg), a torch tensor or a CuPy
    array."""
    return arg if isinstance(arg, int) else _address(arg)


def _bf16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


# Configs and the NVLink bytes they need, computed once per distinct argument set (they sit on every call's path).
@functools.lru_cache(maxsize=256)
def _channels_config(num_sms: int, nvl_chunk_send: int, nvl_chunk_recv: int) -> Config:
    return Config(num_sms, nvl_chunk_send, nvl_chunk_recv)


@functools.lru_cache(maxsize=1024)
def _nvl_need(config: Config, num_ranks: int, hidden: int, num_topk: int, num_experts: int, fp8: bool) -> int:
    return config.nvl_bytes(num_ranks, hidden, num_topk, num_experts, fp8)


class _Profile:
    """Host timestamps and stream events of the last call, when EPJIT_PROFILE=1 (off: every method is a no-op)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.marks: list[tuple[str, float, Any]] = []
        self._events: list[Any] = []  # reused call after call (creating an event costs microseconds)
        self._used = 0
        # per kernel launched: its name, the point names of its enum and its per-block stamps (timeline.cuh)
        self.timelines: list[tuple[str, tuple[str, ...], Any]] = []

    def start(self) -> None:
        if self.enabled:
            self.marks = [("start", time.perf_counter(), None)]
            self._used = 0
            self.timelines = []

    def timeline(self, name: str, num_blocks: int, points: tuple[str, ...]) -> int:
        """The address of zeroed stamps for one kernel launch of num_blocks blocks, or 0 (no stamps) when off."""
        if not self.enabled:
            return 0
        stamps = _cupy().zeros(num_blocks * TIMELINE_SLOTS, dtype=np.uint64)
        self.timelines.append((name, points, stamps))
        return stamps.data.ptr

    def mark(self, name: str, stream: Any = None) -> None:
        if self.enabled:
            t = time.perf_counter()
            event = None
            if stream is not None:
                if self._used == len(self._events):
                    self._events.append(_cupy().cuda.Event())
                event = self._events[self._used]
                self._used += 1
                event.record(stream)
            self.marks.append((name, t, event))

    def report(self) -> dict[str, float]:
        """Microseconds: host time from the call's start to each mark, and GPU time between recorded events."""
        out: dict[str, float] = {}
        t0 = self.marks[0][1] if self.marks else 0.0
        last_event = None
        for name, t, event in self.marks[1:]:  # low-latency calls keep no marks, only timelines
            out[f"host:{name}"] = round((t - t0) * 1e6, 1)
            if event is not None:
                event.synchronize()
                if last_event is not None:
                    out[f"gpu:{name}"] = round(_cupy().cuda.get_elapsed_time(last_event, event) * 1e3, 1)
                last_event = event
        # Each kernel's points in microseconds from its first block's start: earliest, median and latest block (a
        # block that never reached a point is left out).
        for name, points, timeline in self.timelines:
            stamps, t0 = self._stamps(timeline)
            for i, point in enumerate(points):
                reached = stamps[:, i][stamps[:, i] > 0]
                if len(reached):
                    out[f"{name}:{point}:min"] = round(float(reached.min() - t0) / 1e3, 1)
                    out[f"{name}:{point}:med"] = round(float(np.median(reached) - t0) / 1e3, 1)
                    out[f"{name}:{point}:max"] = round(float(reached.max() - t0) / 1e3, 1)
        return out

    @staticmethod
    def _stamps(timeline: Any) -> tuple[np.ndarray, int]:
        """A kernel's stamps, one row a block, and its first block's start (ns)."""
        stamps = timeline.get().reshape(-1, TIMELINE_SLOTS).astype(np.int64)
        return stamps, int(stamps[:, 0][stamps[:, 0] > 0].min(initial=np.iinfo(np.int64).max))

    def blocks(self) -> dict[str, list[tuple[int, ...]]]:
        """Per kernel, one row a block: its SM, its tag (the channel it served; -1: none), then its points in
        microseconds from the kernel's first block's start (-1: not reached). Which blocks are late, and whether
        they share a TPC or GPC, is in here."""
        out: dict[str, list[tuple[int, ...]]] = {}
        for name, points, timeline in self.timelines:
            stamps, t0 = self._stamps(timeline)
            tagged = len(points) <= TIMELINE_TAG_SLOT  # else the tag slot holds a point (timeline.cuh)
            out[name] = [(int(row[TIMELINE_SM_SLOT]) - 1, int(row[TIMELINE_TAG_SLOT]) - 1 if tagged else -1,
                          *(round((int(v) - t0) / 1e3) if v > 0 else -1 for v in row[:len(points)]))
                         for row in stamps if row[0] > 0]  # blocks that never started work (spares) left out
        return out


class Event:
    """A point on the Buffer's communication stream (DeepEP's EventOverlap)."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        """Make the caller's current stream wait for the work before this event."""
        _cupy().cuda.get_current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()


@dataclass
class DispatchLayout:
    """What get_dispatch_layout computes (arrays in the caller's framework)."""

    num_tokens_per_rank: Any  # [R] int32
    num_tokens_per_rdma_rank: Any  # [nodes] int32, or None inside one NVLink node
    num_tokens_per_expert: Any  # [E] int32
    is_token_in_rank: Any  # [N, R] bool
    event: Event | None = None
    # [1] int32 on the GPU: top-k entries outside [-1, E) the layout kernel skipped; the next dispatch's notify
    # reports them on every rank (no host synchronisation here, so the layout can be captured in a CUDA graph).
    invalid_ids: Any = field(default=None, repr=False)
    # What get_dispatch_layout made (the arrays above and their kernel arguments): dispatch skips checking them.
    made: _MadeLayout | None = field(default=None, repr=False)


class _MadeLayout(NamedTuple):
    per_rank: Any  # the DispatchLayout's arrays as get_dispatch_layout made them (identity tells they are unchanged)
    per_expert: Any
    in_rank: Any
    per_rank_arg: Any  # their kernel arguments: addresses (or CuPy arrays)
    per_expert_arg: Any
    in_rank_arg: Any
    in_rank_kept: Any  # what a handle keeps as is_token_in_rank
    num_tokens: int
    num_experts: int


class _Ints(NamedTuple):
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


@dataclass
class DispatchHandle:
    """Everything combine (and a cached dispatch) needs to replay a routing. Arrays are CuPy, on this GPU, except
    is_token_in_rank: the layout's array that the dispatch read (a torch tensor for torch callers)."""

    rank_prefix_ints: _Ints = field(repr=False)  # [R, R]: [i, j] = tokens ranks 0..i send to rank j
    channel_prefix_ints: _Ints = field(repr=False)  # [R, C]: tokens of my channels 0..c bound for rank r
    recv_channel_offset_ints: _Ints = field(repr=False)  # [R, C]: first received row of (source rank, channel)
    recv_src_ints: _Ints = field(repr=False)  # [rows or more]: source token index of each received row
    is_token_in_rank: Any  # [N, R] bool
    send_head_ints: _Ints = field(repr=False)  # [N, R]: ring index token t took towards r (or -(next index)-1)
    # [1]: what notify found (0: nothing): the dispatch and every combine of this handle do nothing unless 0, so a
    # handle from a refused worst-token dispatch, used before the refusal is raised, cannot send garbage receipts.
    status_ints: _Ints = field(repr=False)
    num_tokens: int
    num_recv_tokens: int  # -1 when unknown to the host (worst-token mode)
    num_rows: int  # rows of the dispatched arrays
    num_channels: int
    hidden: int
    num_topk: int
    num_experts: int
    buffer_id: int = field(default=0, repr=False)

    # CuPy views, made when read (a dispatch's host time is what a small batch waits for).
    @property
    def rank_prefix_matrix(self) -> Any:
        return self.rank_prefix_ints.view()

    @property
    def channel_prefix_matrix(self) -> Any:
        return self.channel_prefix_ints.view()

    @property
    def recv_channel_offset(self) -> Any:
        return self.recv_channel_offset_ints.view()

    @property
    def recv_src_idx(self) -> Any:
        return self.recv_src_ints.view(self.num_rows)

    @property
    def send_head(self) -> Any:
        return self.send_head_ints.view()


@dataclass
class DispatchResult:
    x: Any
    x_scales: Any
    topk_idx: Any
    topk_weights: Any
    num_recv_tokens_per_expert: list[int]
    handle: DispatchHandle
    event: Event


@dataclass
class CombineResult:
    x: Any
    topk_weights: Any
    event: Event


@dataclass
class LowLatencyHandle:
    """What low-latency combine needs to send a dispatch's rows home. Arrays: the caller's framework (public) and
    torch or CuPy (internal: what the kernels get the addresses of)."""

    src_info: Any  # [L, R*max] int32: source token index of each received row
    layout_range: Any  # [L, R] int64: begin << 32 | count of each source's block
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_topk: int
    src_info_dev: Any = field(repr=False)
    layout_range_dev: Any = field(repr=False)
    topk_slot: Any = field(repr=False)  # [L, R*max] int32: which top-k slot of its token each row answers
    buffer_id: int = field(default=0, repr=False)
    pending: list[bool] = field(default_factory=lambda: [False], repr=False)  # its dispatch's hook not yet run


@dataclass
class LowLatencyDispatchResult:
    x: Any  # [L, R*max, H] float8_e4m3fn or bf16; rows past recv_count[e] are garbage
    x_scales: Any  # [L, R*max, H/128] float32 (uint8 exponents with use_ue8m0), or None for bf16
    recv_count: Any  # [L] int32
    handle: LowLatencyHandle
    event: Event
    hook: Callable[[], None] | None  # with return_recv_hook: runs the receive half (once)

    @property
    def src_info(self) -> Any:
        return self.handle.src_info

    @property
    def layout_range(self) -> Any:
        return self.handle.layout_range


@dataclass
class LowLatencyCombineResult:
    x: Any  # [N, H] bf16
    event: Event
    hook: Callable[[], None] | None


class _LowLatencyState:
    """A low-latency Buffer's device words, kernels and bookkeeping of the two buffer sets."""

    def __init__(self, buffer: Buffer) -> None:
        cupy = _cupy()
        env = settings()
        self.force_puts = int(env.ll_force_puts)
        puts = low_latency_needs_puts(bool(self.force_puts), buffer.mem.sym)
        self.module = jit.load(LowLatencyPutsSpec() if puts else LowLatencySpec(), buffer.group.device)
        self.sync = cupy.zeros(SYNC_BYTES // 4 + buffer.num_experts, dtype=cupy.int32)  # + expert_sent
        self.sync_ptr = self.sync.data.ptr  # kernel arguments as ints take the launcher's fast path
        # Written by the kernels only (publish_status in cuda_src/low_latency.cu): [0] counts the reports, [1 + b]
        # the calls that raised status bit b; status_seen is what the host has raised of them.
        self.host_status = MappedHostArray(64)
        self.status_seen = np.zeros(1 + STATUS_BIT_COUNT, dtype=np.int32)
        self.next_set = 0
        self.pending: list[str | None] = [None, None]  # per set: which call's hook has not run yet
        self.combine_buffers: list[Any] = [None, None]  # get_next_low_latency_combine_buffer, per set
        props = cupy.cuda.runtime.getDeviceProperties(buffer.group.device)
        self.num_sms = min(int(props["multiProcessorCount"]), env.ll_num_sms or _LL_MAX_SMS)

    def close(self) -> None:
        self.host_status.close()


def low_latency_needs_puts(force_puts: bool, heap: SymmetricHeap | None) -> bool:
    """Whether the low-latency kernels need their build with NVSHMEM puts (LowLatencyPutsSpec): puts forced, or a
    peer without an NVLink pointer. The build without NVSHMEM's device library launches 1-2 us faster."""
    return force_puts or heap is None or not heap.has_direct_peers


_PHASE_SUFFIX = {PHASE_SEND: ".send", PHASE_RECV: ".recv", PHASE_SEND | PHASE_RECV: ""}
# Blocks of a low-latency kernel (one an SM). Both receive halves are bound by what an SM loads (~45 GB/s): 128
# tokens x top-8 x 7168 bf16 are 14.7 MB for combine's. 2 x H200, 128 tokens, alternating runs: dispatch 31.0 /
# 31.1 -> 29.9 / 30.1 us and combine 45.3 / 46.0 -> 43.4 / 43.3 from 64 to 128 blocks (1 token: +0.2-0.4 us); 4 x
# H200, one run each: 36.4 -> 35.8 and 58.4 -> 55.5, 132 no better.
_LL_MAX_SMS = 128


class Buffer:
    """Peer memory, streams and kernels for expert-parallel dispatch/combine (a collective object: every rank of
    the group constructs and closes it together)."""

    def __init__(self, group: Group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_max_dispatch_tokens_per_rank: int = 0, hidden: int = 0, num_experts: int = 0) -> None:
        if not isinstance(group, Group):
            raise ArgumentTypeError(with_rank(f"group must be what epjit.init() returns, got {type(group).__name__}"))
        group.check_same("Buffer(num_nvl_bytes, num_rdma_bytes, low_latency_mode)",
                         (int(num_nvl_bytes), int(num_rdma_bytes), bool(low_latency_mode)))
        if group.device is None:
            raise SetupError(with_rank("epjit.Buffer needs a GPU, and epjit.init() bound none on this rank"))
        self.group = group
        self.num_ranks = group.size
        self.rank = group.rank
        self.low_latency_mode = bool(low_latency_mode)
        self.num_max_dispatch_tokens_per_rank = int(num_max_dispatch_tokens_per_rank)
        self.hidden = int(hidden)
        self.num_experts = int(num_experts)
        if self.low_latency_mode:
            num_rdma_bytes = self._check_low_latency_args(int(num_rdma_bytes))
        if num_nvl_bytes or not self.low_latency_mode:  # normal mode (a low-latency Buffer may have both)
            if group.num_nvl_ranks != group.size:
                raise SetupError(with_rank(
                    f"normal mode across NVLink nodes is not available yet ({group.size} ranks in nodes of "
                    f"{group.num_nvl_ranks}): use one NVLink node (num_nvl_ranks = size)"))
            minimum = intranode_min_nvl_bytes(group.size, MAX_CHANNELS)
            if num_nvl_bytes < minimum:
                raise ArgumentError(with_rank(
                    f"num_nvl_bytes={num_nvl_bytes} is below the {minimum} bytes of control words every call "
                    f"needs; Buffer.get_normal_size_hint(...) gives a size for given shapes"))
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self._intranode_spec: IntranodeSpec | None = None
        if self.num_nvl_bytes:  # the normal-mode kernels' warp roles: the defaults, or EPJIT_INTRANODE_VARIANT's
            try:
                self._intranode_spec = configured_intranode_spec(self.num_ranks)
            except ValueError as e:
                raise SetupError(with_rank(f"EPJIT_INTRANODE_VARIANT: {e}")) from None
            # What a call without a config gets (chunks sized by the spec's sending warps).
            self._dispatch_config = get_dispatch_config(self.num_ranks, self._intranode_spec)
            self._combine_config = get_combine_config(self.num_ranks, self._intranode_spec)
        cupy = _cupy()
        self._device = cupy.cuda.Device(group.device)
        self.mem = PeerMemory.create(group, self.num_nvl_bytes, self.num_rdma_bytes)
        self._host_records: list[MappedHostArray | None] = [None] * _HOST_RECORDS  # see _HOST_RECORDS
        self._record_pool: MappedHostArray | None = None  # the records' memory, one allocation (made with them)
        self._host_record_calls = [-1] * _HOST_RECORDS  # the dispatch (numbered from 0) that last used each
        self._host_calls = 0
        # The record of every dispatch captured in a CUDA graph: replays write it whenever they run, the host never
        # reads it, and no eager call shares it. Made here: pinned memory cannot be allocated during a capture.
        self._graph_record: MappedHostArray | None = None
        # Worst-token dispatches whose record is not read yet, oldest first: (call, event, record, num_worst_tokens).
        self._pending: collections.deque[tuple[int, Event, MappedHostArray, int]] = collections.deque()
        self._ll: _LowLatencyState | None = None
        try:
            with self._device:
                self.comm_stream = cupy.cuda.Stream(non_blocking=True)
                # cuda_src/placement.cuh's ChannelClaims for dispatch, then for combine: zero before the first
                # launch; each launch's last block zeroes them for the next.
                self._claims = cupy.zeros(2 * CLAIMS_INTS, dtype=cupy.int32)
                base = self._claims.data.ptr
                self._claims_ptrs = (base, base + self._claims.itemsize * CLAIMS_INTS)
            self._num_device_sms = int(self._device.attributes["MultiProcessorCount"])
            self._recv_rates: collections.deque[float] = collections.deque(maxlen=_RATE_HISTORY)  # rows a token
            self._dispatch_retries = 0  # dispatches run again because their outputs were too small (tests read it)
            if self.num_nvl_bytes:
                self._graph_record = MappedHostArray(self._host_record_bytes(max(self.num_experts, 4096)))
                # One cudaHostAlloc for the 64 records, not one in each of the first 64 dispatches.
                self._record_pool = MappedHostArray(_HOST_RECORDS * _HOST_RECORD_BYTES)
                self._host_records[:] = self._record_pool.parts(_HOST_RECORD_BYTES)
                self._layout_module = jit.load(LayoutSpec(), group.device)
                self._notify_module = jit.load(IntranodeNotifySpec(self.num_ranks), group.device)
                self._main_module = jit.load(self._intranode_spec, group.device)
            if self.low_latency_mode:
                with self._device:
                    self._ll = _LowLatencyState(self)
        except BaseException:
            if self._ll is not None:
                self._ll.close()
            for record in (self._graph_record, self._record_pool):
                if record is not None:
                    record.close()
            self.mem.close()
            raise
        self._closed = False
        self._settings = settings()  # read once: the environment is not re-read on the hot path
        self._profile = _Profile(self._settings.profile)
        self._order_event: Any = None  # _begin's event (made on first use)
        self._torch_comm: Any = None  # the communication stream as a torch stream (made on first use)

    def profile(self) -> dict[str, float]:
        """Where the last dispatch/combine spent its time (needs EPJIT_PROFILE=1; waits for that call's work).

        Low-latency calls report, for each kernel they launched, when its blocks reached each point of
        cuda_src/low_latency.cu's TimelinePoint: ``<kernel>:<point>:med`` / ``:max`` in microseconds from the first
        block's start (a block that never reached a point is left out)."""
        return self._profile.report()

    def profile_blocks(self) -> dict[str, list[tuple[int, ...]]]:
        """The last call's stamps block by block (needs EPJIT_PROFILE=1): per kernel, one row a block with its SM
        id and its channel (-1: none), then its points in microseconds from the first block's start (-1: not
        reached)."""
        return self._profile.blocks()

    # ------------------------------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Collective: wait for this Buffer's work, then release the peer memory on every rank. What a refused or
        wrong earlier call found and no call has raised yet is raised here, once everything is released."""
        if self._closed:
            return
        self._closed = True
        refusal: ArgumentError | None = None
        try:
            self.mem.synchronize(self.comm_stream)
            try:
                self._check_pending()
                self._raise_low_latency_status()
            except ArgumentError as e:
                refusal = e
        finally:
            for record in (*self._host_records, self._graph_record, self._record_pool):
                if record is not None:
                    record.close()  # a pooled record's does nothing; the pool's, last, frees them all
            if self._ll is not None:
                self._ll.close()
            self.mem.close()
        if refusal is not None:
            raise refusal

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except ArgumentError:
            pass  # a refusal found on the way out: the exception already leaving the with-block is the one to see

    @staticmethod
    def get_normal_size_hint(num_ranks: int, hidden: int, num_topk: int = 8, num_experts: int = 256,
                             config: Config | None = None) -> int:
        """num_nvl_bytes for normal-mode dispatch and combine of these sizes with the default (or given) config."""
        return max(normal_size_hint(num_ranks, hidden, num_topk, num_experts, config),
                   intranode_min_nvl_bytes(num_ranks, MAX_CHANNELS))

    # ------------------------------------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise EpjitError(with_rank("this Buffer is closed"))

    def _check_normal(self) -> None:
        self._check_open()
        if not self.num_nvl_bytes:
            raise EpjitError(with_rank("this Buffer has no NVLink buffer (num_nvl_bytes=0): normal-mode calls need "
                                       "one (Buffer.get_normal_size_hint)"))

    def _host_record_bytes(self, num_experts: int) -> int:
        return max(4 * (2 + (META_INTS + 1) * self.num_ranks + num_experts // self.num_ranks), _HOST_RECORD_BYTES)

    def _host_record(self, num_experts: int, captured: bool = False) -> tuple[MappedHostArray, int]:
        """The host record notify fills for this dispatch, and the call's number (-1 for a captured one)."""
        need = self._host_record_bytes(num_experts)
        if captured:
            assert self._graph_record is not None  # made with the NVLink buffer, for up to 4096 experts
            if need > self._graph_record.num_bytes:
                raise ArgumentError(with_rank(f"a dispatch captured in a CUDA graph takes up to 4096 experts (or the "
                                              f"Buffer's num_experts), got {num_experts}"))
            return self._graph_record, -1
        call, i = self._host_calls, self._host_calls % _HOST_RECORDS
        self._host_calls += 1
        while self._pending and self._pending[0][0] <= self._host_record_calls[i]:
            self._report_oldest()  # the record's last writer first (waiting for it, if the host ran this far ahead)
        self._host_record_calls[i] = call
        record = self._host_records[i]
        if record is None or record.num_bytes < need:
            if record is not None:
                record.close()  # its call is over: it waited for its counts, or was just reported
            record = self._host_records[i] = MappedHostArray(need)
        return record, call

    def _begin(self, previous_event: Event | None) -> Any:
        """Order the communication stream after the caller's work; returns the caller's stream."""
        cupy = _cupy()
        caller = cupy.cuda.get_current_stream()
        if previous_event is not None:
            if not isinstance(previous_event, Event):
                raise ArgumentTypeError(with_rank(
                    f"previous_event must be an epjit Event, got {type(previous_event).__name__}"))
            self.comm_stream.wait_event(previous_event.event)
        else:
            # One event, re-recorded every call: a wait is on the record made before it, whatever comes later.
            if self._order_event is None:
                self._order_event = cupy.cuda.Event(disable_timing=True)
            self._order_event.record(caller)
            self.comm_stream.wait_event(self._order_event)
        return caller

    def _finish(self, caller: Any, async_finish: bool) -> Event:
        event = Event(_cupy().cuda.Event(disable_timing=True))
        event.event.record(self.comm_stream)
        if not async_finish:
            caller.wait_event(event.event)
        return event

    def _torch_outputs(self, *specs: tuple[tuple[int, ...], str] | None) -> tuple[Any, ...]:
        """torch outputs (None where a spec is None), allocated by torch itself: no CuPy pool, no DLPack.

        torch allocates on the caller's stream, which is torch's current stream (see _callers_stream); the kernels
        write them on the communication stream, which _begin ordered after everything already queued on the
        caller's stream (so after the last use of a reused block) -- which is why this is only for calls without
        previous_event (those allocate with CuPy on the communication stream and hand the arrays over, as JAX
        calls do). The caller's stream waits for the call's event before it can use or free them, or with
        async_finish, _used_by_comm_stream tells the allocator.
        """
        dev = self.group.device
        outs = tuple(None if spec is None else arrays.empty("torch", spec[0], spec[1], dev) for spec in specs)
        if self._settings.poison_outputs:  # see _empty; on the communication stream, before the kernels
            memset = _cupy().cuda.runtime.memsetAsync
            for t in outs:
                if t is not None and t.numel():
                    memset(t.data_ptr(), _POISON_BYTE, t.numel() * t.element_size(), self.comm_stream.ptr)
        return outs

    def _torch_comm_stream(self) -> Any:
        if self._torch_comm is None:
            torch = sys.modules["torch"]
            self._torch_comm = torch.cuda.ExternalStream(self.comm_stream.ptr,
                                                         device=torch.device("cuda", self.group.device))
        return self._torch_comm

    def _used_by_comm_stream(self, tensors: tuple[Any, ...]) -> None:
        """async_finish with torch: the caller's stream does not wait for the communication stream, so tell torch's
        allocator that these tensors are in use there until its work so far is done (DeepEP does the same);
        otherwise one the caller drops early could be handed out again while a kernel still reads or writes it."""
        stream = None
        for t in tensors:
            if t is not None and type(t).__module__.startswith("torch"):
                if stream is None:
                    stream = self._torch_comm_stream()
                t.record_stream(stream)

    def _sync(self) -> None:
        """Wait for the communication stream; a kernel timeout becomes EpjitTimeoutError."""
        self.mem.synchronize(self.comm_stream)

    def _wait_for_counts(self, host: MappedHostArray) -> None:
        """Wait until notify has filled host_out: spin on its first word, which notify writes last with a
        system-scope release (it starts at -1), as DeepEP's host does: the host sees the counts as soon as they
        land, not after the stream's later work or a synchronisation's wake-up. Every 4096 polls (~0.5 ms) the
        stream is queried with cudaStreamQuery itself (polling CuPy's Stream.done, the timeout test hung past the
        kernel's trap, as if an error read as "not done"), so a kernel error or a timeout trap, after which the word
        never comes, raises as _sync would. Not more often: a query took 4-9 us on a lent host, and counts landing
        during one wait for it (every 256 polls, a 128-token dispatch made ~10 of them)."""
        from cuda.bindings import runtime as cudart

        ints = host.ints
        stream_ptr = self.comm_stream.ptr
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

    def _empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        cupy = _cupy()
        out = cupy.empty(shape, dtype=dtype)
        if self._settings.poison_outputs and out.size:
            out.view(cupy.uint8).fill(_POISON_BYTE)
        return out

    def _recv_rows_estimate(self, num_tokens: int) -> int:
        """Rows of dispatch output to allocate before the counts are known: R x N the first time (every token to
        every rank; more arrive only when other ranks send more tokens than this one), then the most rows per
        token of the last _RATE_HISTORY calls, times N, plus 1/16 and 128 rows. The most, not the last: one Buffer
        serves every MoE layer of a model, each with its own routing balance, and a call that does not fit costs
        a second notify (notify stops it on every rank and it runs again with the exact rows)."""
        if not self._recv_rates:
            return self.num_ranks * num_tokens
        return int(max(self._recv_rates) * num_tokens * 17 / 16) + 128

    def _dispatch_outputs(self, direct: bool, rows: int, hidden: int, num_scales: int, num_topk: int, fp8: bool,
                          with_idx: bool, with_weights: bool) -> tuple[Any, ...]:
        """recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights (None where not asked for)."""
        cupy = _cupy()
        if direct:
            outs = self._torch_outputs(((rows, hidden), "float8_e4m3fn" if fp8 else "bfloat16"),
                                       ((rows, num_scales), "float32") if fp8 else None,
                                       ((rows, num_topk), "int64") if with_idx else None,
                                       ((rows, num_topk), "float32") if with_weights else None)
        else:
            outs = (self._empty((rows, hidden), cupy.uint8 if fp8 else _bf16()),
                    self._empty((rows, num_scales), cupy.float32) if fp8 else None,
                    self._empty((rows, num_topk), cupy.int64) if with_idx else None,
                    self._empty((rows, num_topk), cupy.float32) if with_weights else None)
        return outs

    def _dispatch_ints(self, num_channels: int, num_tokens: int, capacity: int,
                       handle: DispatchHandle | None) -> tuple[_Ints, ...]:
        """rank_prefix_matrix and channel_prefix_matrix (a replayed handle's), recv_channel_offset, send_head,
        recv_src_idx and the status word of one dispatch, carved from one CuPy allocation: one allocation and no
        array objects (a small batch waits for this host's time). The caller has made the communication stream
        CuPy's current stream."""
        r = self.num_ranks
        shapes = [(r, r), (r, num_channels)] if handle is None else []
        shapes += [(r, num_channels), (num_tokens, r), (capacity,), (1,)]
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += (math.prod(shape) + 63) // 64 * 64  # 256-byte aligned parts
        cupy = _cupy()
        owner = cupy.empty(max(total, 1), dtype=cupy.int32)
        if self._settings.poison_outputs:
            owner.view(cupy.uint8).fill(_POISON_BYTE)
        base = owner.data.ptr
        parts = tuple(_Ints(owner, o, shape, base + 4 * o) for o, shape in zip(offsets, shapes, strict=True))
        return parts if handle is None else (handle.rank_prefix_ints, handle.channel_prefix_ints, *parts)

    def _check_status(self, ints: np.ndarray, num_worst_tokens: int, replayed: bool = False) -> None:
        """Raise what notify's record `ints` says it refused (nothing when its status is 0)."""
        status = int(ints[1])
        if status == 0:
            return
        r = self.num_ranks
        meta = ints[2:2 + META_INTS * r].reshape(r, META_INTS).copy()
        totals = ints[2 + META_INTS * r:2 + (META_INTS + 1) * r].copy()
        problems = []
        if status & _STATUS_LAYOUT_TOO_BIG:
            problems.append(f"the call's rings do not fit num_nvl_bytes={self.num_nvl_bytes} on some rank "
                            "(a larger Buffer or smaller Config.nvl_chunk_recv / num_sms)")
        if status & _STATUS_INVALID_IDS:
            ranks = [i for i in range(r) if meta[i, 3] & _META_INVALID_IDS]
            problems.append(f"topk_idx has entries outside [-1, num_experts={int(meta[ranks[0], 1])}) on rank(s) "
                            f"{', '.join(map(str, ranks))}")
        if status & _STATUS_META_MISMATCH:
            for j, name in enumerate(_META_NAMES):
                column = meta[:, j] & ~_OWN_META_BITS if name == "flags" else meta[:, j]
                if len(set(column.tolist())) > 1:
                    values = ", ".join(f"rank {i}: {self._describe_meta(name, int(v))}" for i, v in enumerate(column))
                    problems.append(f"{name} differs across ranks: {values}")
        if status & _STATUS_WORST_TOO_SMALL:
            values = ", ".join(f"rank {i}: {int(v)} for {int(meta[i, 4])}" for i, v in enumerate(totals)
                               if meta[i, 3] & _FLAG_WORST_TOKENS and v > meta[i, 4])
            problems.append(f"num_worst_tokens={num_worst_tokens} is too small for what arrives (rows received for "
                            f"num_worst_tokens: {values})")
        if status & _STATUS_OVER_CAPACITY and not problems:
            values = ", ".join(f"rank {i}: {int(v)} for {int(meta[i, 4])}" for i, v in enumerate(totals)
                               if meta[i, 4] < v)
            problems.append(f"the routing does not match the handle's (rows received for rows expected: {values})")
        what = "a dispatch replayed from a CUDA graph was" if replayed else "dispatch"
        raise ArgumentError(with_rank(f"{what} refused on every rank: " + "; ".join(problems)))

    @staticmethod
    def _describe_meta(name: str, value: int) -> str:
        if name != "flags":
            return str(value)
        parts = [("FP8" if value & _FLAG_FP8 else "bf16"), ("weights" if value & _FLAG_WEIGHTS else "no weights"),
                 ("topk_idx" if value & _FLAG_TOPK else "no topk_idx")]
        return "/".join(parts)

    def _check_pending(self) -> None:
        """Raise what earlier worst-token dispatches' notify found, oldest first, for those their stream got past."""
        graph = self._graph_record
        graph_refused = graph is not None and graph.ints[1] != 0  # a replay refused since the last look
        if not (self._pending or graph_refused) or _capturing():  # the common case asks the stream nothing
            return
        while self._pending and self._pending[0][1].event.done:
            self._report_oldest()
        if graph_refused:
            assert graph is not None
            seen = graph.ints.copy()
            graph.ints[1] = 0
            me = self.rank % self.num_ranks
            self._check_status(seen, int(seen[2 + META_INTS * me + 4]), replayed=True)

    def _report_oldest(self) -> None:
        """Wait for the oldest unreported worst-token dispatch and raise what its notify found (once)."""
        _, event, record, num_worst_tokens = self._pending.popleft()
        try:
            event.event.synchronize()
        except _cupy().cuda.runtime.CUDARuntimeError as e:
            self.mem.raise_for(e)
        self._check_status(record.ints, num_worst_tokens)

    # ------------------------------------------------------------------------------------------------ layout

    @_on_callers_stream
    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Event | None = None,
                            async_finish: bool = False) -> DispatchLayout:
        """Counts per rank and per expert, and is_token_in_rank, for topk_idx [N, K] int64 (-1 = no expert)."""
        self._check_normal()
        cupy = _cupy()
        dev = self.group.device
        info = arrays.check(topk_idx, "topk_idx", dtype="int64", ndim=2, device=dev)
        num_experts = self._check_num_experts(num_experts)
        idx = arrays.kernel_arg(topk_idx, info, "topk_idx")
        num_tokens, num_topk = info.shape
        r = self.num_ranks
        fw = info.framework
        caller = self._begin(previous_event)
        direct = fw == "torch" and previous_event is None  # see _torch_outputs
        # The kernel adds into the counts: one zeroed int32 allocation holds them all (one memset, on the
        # communication stream); it writes every row of is_token_in_rank, which needs no zeroing.
        if direct:
            counts = arrays.empty("torch", (r + num_experts + 1,), "int32", dev)
            per_rank, per_expert, invalid = counts.split_with_sizes((r, num_experts, 1))
            in_rank = arrays.empty("torch", (num_tokens, r), "bool", dev)
            base = counts.data_ptr()
            cupy.cuda.runtime.memsetAsync(base, 0, 4 * (r + num_experts + 1), self.comm_stream.ptr)
            ptrs = (base, base + 4 * r, in_rank.data_ptr(), base + 4 * (r + num_experts))
        else:
            with self.comm_stream:
                counts = cupy.zeros(r + num_experts + 1, dtype=cupy.int32)
                per_rank, per_expert, invalid = counts[:r], counts[r:r + num_experts], counts[r + num_experts:]
                in_rank = cupy.empty((num_tokens, r), dtype=cupy.bool_)
            ptrs = (per_rank.data.ptr, per_expert.data.ptr, in_rank.data.ptr, invalid.data.ptr)
        if self._settings.poison_outputs and num_tokens:  # the tests: a row the kernel missed would show
            cupy.cuda.runtime.memsetAsync(ptrs[2], _POISON_BYTE, num_tokens * r, self.comm_stream.ptr)
        if num_tokens:
            block = 256
            shared = 4 * (num_experts + 2 * r)
            self._layout_module.launch("dispatch_layout", (num_tokens + block - 1) // block, block, idx, num_tokens,
                                       num_topk, num_experts, r, r, ptrs[0], 0, ptrs[1], ptrs[2], ptrs[3],
                                       shared_mem=shared, stream=self.comm_stream)
        event = self._finish(caller, async_finish)
        if direct:
            if async_finish:
                self._used_by_comm_stream((topk_idx, per_rank, per_expert, in_rank, invalid))
            outs = (per_rank, per_expert, in_rank)
        elif fw == "cupy":
            outs = (per_rank, per_expert, in_rank)
        else:
            outs = (arrays.from_cupy(per_rank, fw), arrays.from_cupy(per_expert, fw), arrays.from_cupy(in_rank, fw))
        layout = DispatchLayout(outs[0], None, outs[1], outs[2], event, invalid_ids=invalid)
        layout.made = _MadeLayout(outs[0], outs[1], outs[2], ptrs[0], ptrs[1], ptrs[2], in_rank, num_tokens,
                                  num_experts)
        return layout

    def _layout_arrays(self, layout: DispatchLayout, num_tokens: int) -> tuple[Any, Any, Any, Any, int]:
        """Kernel arguments for a layout's num_tokens_per_rank, num_tokens_per_expert and is_token_in_rank, the
        is_token_in_rank array a handle keeps, and the number of experts: validated, or taken as made if
        get_dispatch_layout made them."""
        made = layout.made
        if made is not None and made.per_rank is layout.num_tokens_per_rank \
                and made.per_expert is layout.num_tokens_per_expert and made.in_rank is layout.is_token_in_rank \
                and made.num_tokens == num_tokens:
            return made.per_rank_arg, made.per_expert_arg, made.in_rank_arg, made.in_rank_kept, made.num_experts
        dev = self.group.device
        r_info = arrays.check(layout.num_tokens_per_rank, "layout.num_tokens_per_rank", dtype="int32",
                              shape=(self.num_ranks,), device=dev)
        e_info = arrays.check(layout.num_tokens_per_expert, "layout.num_tokens_per_expert", dtype="int32", ndim=1,
                              device=dev)
        t_info = arrays.check(layout.is_token_in_rank, "layout.is_token_in_rank", dtype="bool",
                              shape=(("N", num_tokens), self.num_ranks), shape_note="with N matching x", device=dev)
        per_rank = arrays.kernel_arg(layout.num_tokens_per_rank, r_info, "layout.num_tokens_per_rank")
        per_expert = arrays.kernel_arg(layout.num_tokens_per_expert, e_info, "layout.num_tokens_per_expert")
        in_rank = arrays.kernel_arg(layout.is_token_in_rank, t_info, "layout.is_token_in_rank")
        kept = layout.is_token_in_rank if isinstance(in_rank, int) else in_rank  # an address, or a CuPy view
        return per_rank, per_expert, in_rank, kept, e_info.shape[0]

    def _check_num_experts(self, num_experts: int) -> int:
        if not isinstance(num_experts, (int, np.integer)) or num_experts <= 0:
            raise ArgumentError(with_rank(f"num_experts must be a positive int, got {num_experts!r}"))
        if num_experts % self.num_ranks:
            raise ArgumentError(with_rank(f"num_experts={num_experts} is not divisible by the {self.num_ranks} "
                                          "ranks (each rank owns num_experts / ranks experts)"))
        return int(num_experts)

    # ------------------------------------------------------------------------------------------------ dispatch

    @_on_callers_stream
    def dispatch(self, x: Any, topk_idx: Any = None, topk_weights: Any = None, layout: DispatchLayout | None = None,
                 handle: DispatchHandle | None = None, num_worst_tokens: int = 0, expert_alignment: int = 1,
                 config: Config | None = None, previous_event: Event | None = None,
                 async_finish: bool = False, num_experts: int | None = None) -> DispatchResult:
        """Send every token to each rank owning one of its experts (DESIGN.md: normal dispatch semantics).

        x is [N, H] bf16, or a pair (x_fp8 [N, H] float8_e4m3fn, scales [N, H/128] float32). Without a handle,
        ``layout`` (from get_dispatch_layout) is required, or topk_idx plus num_experts (here or on the Buffer).
        With a handle, the routing of that earlier dispatch is replayed with no layout pass.

        The outputs are allocated before the counts are known, so the GPU does not wait for this host: without
        num_worst_tokens or a handle they are views of the first rows of arrays sized by an estimate (R x N rows
        the first time, then the most rows per token of the last 32 calls, + 1/16 + 128 rows); when some rank's
        rows do not fit, every rank runs the call again with exact sizes.
        """
        self._check_normal()
        self._check_pending()
        profile = self._profile
        profile.start()
        dev = self.group.device
        # ---- validate everything before any kernel runs
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ArgumentError(with_rank(f"x must be an array or a pair (x_fp8, scales), got {len(x)} items"))
            x_info = arrays.check(x[0], "x", dtype="float8_e4m3fn", ndim=2, device=dev)
            num_tokens, hidden = x_info.shape
            if hidden % 128:
                raise ArgumentError(with_rank(f"FP8 x has hidden={hidden}, which is not a multiple of 128"))
            s_info = arrays.check(x[1], "x_scales", dtype="float32", shape=(("N", num_tokens), hidden // 128),
                                  shape_note="with N matching x and one scale per 128 channels", device=dev)
            x_arg, scales_arg, fp8 = arrays.kernel_arg(x[0], x_info, "x"), arrays.kernel_arg(x[1], s_info,
                                                                                           "x_scales"), True
        else:
            x_info = arrays.check(x, "x", dtype="bfloat16", ndim=2, device=dev)
            num_tokens, hidden = x_info.shape
            x_arg, scales_arg, fp8 = arrays.kernel_arg(x, x_info, "x"), 0, False
        if hidden % 8 or hidden <= 0:
            raise ArgumentError(with_rank(f"hidden={hidden} must be a positive multiple of 8 (16-byte rows)"))
        idx_arg = w_arg = None  # kernel arguments (addresses, or CuPy views for JAX); None: not given
        num_topk = 0
        if topk_idx is not None:
            k_info = arrays.check(topk_idx, "topk_idx", dtype="int64", shape=(("N", num_tokens), "K"),
                                  shape_note="with N matching x", device=dev)
            num_topk = k_info.shape[1]
            idx_arg = arrays.kernel_arg(topk_idx, k_info, "topk_idx")
            if not 1 <= num_topk <= 32:
                raise ArgumentError(with_rank(f"topk_idx has {num_topk} columns; 1 to 32 are supported"))
        if topk_weights is not None:
            if topk_idx is None:
                raise ArgumentError(with_rank("topk_weights given without topk_idx"))
            w_info = arrays.check(topk_weights, "topk_weights", dtype="float32",
                                  shape=(("N", num_tokens), ("K", num_topk)), shape_note="matching topk_idx",
                                  device=dev)
            w_arg = arrays.kernel_arg(topk_weights, w_info, "topk_weights")
        if type(num_worst_tokens) is not int or num_worst_tokens < 0 or type(expert_alignment) is not int \
                or expert_alignment < 1:  # the common case in one test; the loop below says what is wrong
            for name, value in (("num_worst_tokens", num_worst_tokens), ("expert_alignment", expert_alignment)):
                if not isinstance(value, (int, np.integer)) or value < (0 if name == "num_worst_tokens" else 1):
                    raise ArgumentError(with_rank(f"{name} must be an int >= "
                                                  f"{0 if name == 'num_worst_tokens' else 1}, got {value!r}"))
            num_worst_tokens, expert_alignment = int(num_worst_tokens), int(expert_alignment)

        if handle is not None:
            if not isinstance(handle, DispatchHandle) or handle.buffer_id != id(self):
                raise ArgumentError(with_rank("handle must come from a dispatch of this Buffer"))
            if handle.num_tokens != num_tokens or handle.hidden != hidden:
                raise ArgumentError(with_rank(f"x is [{num_tokens}, {hidden}] but the handle was made for "
                                              f"[{handle.num_tokens}, {handle.hidden}]"))
            num_experts_ = handle.num_experts
            if idx_arg is not None and num_topk != handle.num_topk:
                raise ArgumentError(with_rank(f"topk_idx has {num_topk} columns, the handle {handle.num_topk}"))
            num_channels = handle.num_channels
            if config is not None and config.num_channels != num_channels:
                raise ArgumentError(with_rank(f"config.num_sms={config.num_sms} but the handle was made with "
                                              f"{num_channels} SMs"))
            config = config or self._dispatch_config
            config = _channels_config(num_channels, config.nvl_chunk_send, config.nvl_chunk_recv)
        else:
            config = config or self._dispatch_config
            if not isinstance(config, Config):
                raise ArgumentTypeError(with_rank(f"config must be an epjit.Config, got {type(config).__name__}"))
            num_channels = config.num_channels
            if layout is None:
                if idx_arg is None:
                    raise ArgumentError(with_rank("dispatch needs layout=get_dispatch_layout(...), or topk_idx, "
                                                  "or a handle"))
                ne = num_experts if num_experts is not None else self.num_experts
                if not ne:
                    raise ArgumentError(with_rank("dispatch without a layout needs num_experts (here or on the "
                                                  "Buffer) to compute one"))
                layout = self.get_dispatch_layout(topk_idx, ne)
            elif not isinstance(layout, DispatchLayout):
                raise ArgumentTypeError(with_rank(f"layout must be a DispatchLayout, got {type(layout).__name__}"))
            per_rank, per_expert, in_rank, in_rank_kept, layout_experts = self._layout_arrays(layout, num_tokens)
            num_experts_ = self._check_num_experts(int(layout_experts))
        need = _nvl_need(config, self.num_ranks, hidden, num_topk, num_experts_, fp8)
        if need > self.num_nvl_bytes:
            # Every rank computes the same need from the same (checked-in-notify) sizes, so all raise together
            # when the sizes agree; when they do not, notify reports the mismatch on every rank.
            raise ArgumentError(with_rank(
                f"this dispatch needs {need} bytes of NVLink buffer (hidden={hidden}, top-{num_topk}, "
                f"{num_experts_} experts, {config}) but the Buffer has {self.num_nvl_bytes}: use "
                "Buffer.get_normal_size_hint(...)"))

        flags = (_FLAG_FP8 if fp8 else 0) | (_FLAG_WEIGHTS if w_arg is not None else 0) | \
                (_FLAG_TOPK if idx_arg is not None else 0)
        num_scales = hidden // 128 if fp8 else 0
        r = self.num_ranks
        fw = x_info.framework
        direct = fw == "torch" and previous_event is None  # see _torch_outputs
        # Only a worst-token dispatch can be captured (the others wait for their counts): ask the stream only then.
        host, call = self._host_record(num_experts_, captured=num_worst_tokens > 0 and _capturing())
        if call < 0:
            flags |= _FLAG_CAPTURED  # notify writes the graph's record only when it refuses a replay
        comm = self.comm_stream
        table = self.mem.table_ptr
        caller = self._begin(previous_event)
        profile.mark("validated", comm)
        # Outputs are allocated before the counts are known, so that the GPU runs dispatch right after notify
        # instead of idling while the host waits for the counts, allocates and launches (~40-60 us on H200s):
        # num_worst_tokens rows, a handle's exact rows, or an estimate (see _recv_rows_estimate). Notify stops the
        # call on every rank when some rank's rows would not fit; with an estimate, it then runs again with the
        # exact rows, which every rank knows by then.
        estimated = False
        if num_worst_tokens > 0:
            capacity = num_worst_tokens
            flags |= _FLAG_WORST_TOKENS
        elif handle is not None and handle.num_recv_tokens >= 0:
            capacity = handle.num_recv_tokens
        else:  # no handle, or one from a worst-token dispatch (its row count never reached the host)
            capacity, estimated = self._recv_rows_estimate(num_tokens), True
        if handle is None:
            invalid = _address(layout.invalid_ids)
        else:
            in_rank = in_rank_kept = handle.is_token_in_rank
            in_rank = _address(in_rank)
            per_rank = per_expert = invalid = 0
        host_ints = host.ints
        grid = normal_grid(num_channels, self._num_device_sms)
        with comm:  # CuPy allocates on the communication stream (the handle's ints, CuPy callers' outputs)
            for attempt in range(2):
                rank_prefix, channel_prefix, recv_channel_offset, send_head, recv_src, status = \
                    self._dispatch_ints(num_channels, num_tokens, capacity, handle)
                outs = self._dispatch_outputs(direct, capacity, hidden, num_scales, num_topk, fp8,
                                              idx_arg is not None, w_arg is not None)
                profile.mark("allocated", comm)
                host_ints[0], host_ints[1] = -1, 0
                self._notify_module.launch(
                    "intranode_notify", 1 + r, 128, table, per_rank, per_expert, in_rank, num_tokens, num_channels,
                    config.nvl_chunk_recv, hidden, num_topk, num_scales, num_experts_, flags, expert_alignment,
                    capacity, int(handle is not None), invalid, rank_prefix.ptr, channel_prefix.ptr,
                    host.device_ptr, status.ptr, profile.timeline("notify", 1 + r, NOTIFY_TIMELINE_POINTS),
                    stream=comm)
                profile.mark("notify", comm)
                self._main_module.launch(
                    "intranode_dispatch", grid, NUM_THREADS, table, self._claims_ptrs[0], x_arg, scales_arg,
                    0 if idx_arg is None else idx_arg, 0 if w_arg is None else w_arg, in_rank,
                    channel_prefix.ptr, rank_prefix.ptr, status.ptr, _address(outs[0]), _address(outs[1]),
                    recv_src.ptr, _address(outs[2]), _address(outs[3]), recv_channel_offset.ptr,
                    send_head.ptr, num_tokens, hidden, hidden * (1 if fp8 else 2) // 16, num_scales, num_topk,
                    num_experts_, num_channels, config.nvl_chunk_recv, config.nvl_chunk_send, num_worst_tokens,
                    profile.timeline("dispatch", grid, NORMAL_TIMELINE_POINTS), stream=comm, programmatic=True)
                profile.mark("dispatch", comm)
                # The caller's stream waits for the kernels now, before the host waits for the counts: else a host
                # slower than dispatch would put its own time on the caller's stream.
                event = self._finish(caller, async_finish)
                if num_worst_tokens > 0:
                    num_rows, num_recv, per_expert_counts = num_worst_tokens, -1, []
                    break
                self._wait_for_counts(host)
                num_recv = num_rows = int(host_ints[0])
                if int(host_ints[1]) == _STATUS_OVER_CAPACITY and estimated and attempt == 0:
                    capacity = num_recv  # every rank stopped; each runs again with its exact rows
                    self._dispatch_retries += 1
                    continue
                self._check_status(host_ints, 0)
                profile.mark("host_synced")
                if num_tokens > 0:
                    self._recv_rates.append(num_recv / num_tokens)
                if handle is not None:
                    per_expert_counts = []
                    if handle.num_recv_tokens >= 0 and num_recv != handle.num_recv_tokens:
                        raise EpjitError(with_rank(f"cached dispatch received {num_recv} rows, the handle says "
                                                   f"{handle.num_recv_tokens}"))
                else:
                    lo = 2 + (META_INTS + 1) * r
                    per_expert_counts = host_ints[lo:lo + num_experts_ // r].tolist()
                if num_rows < capacity:  # the rows that arrived
                    if direct:  # shrunk in place: 2 x H200's host took ~11 us for four, slicing ~15-30
                        for o in outs:
                            if o is not None:
                                o.resize_((num_rows, o.shape[1]))
                    else:
                        outs = tuple(o[:num_rows] if o is not None else None for o in outs)
                break
        if num_worst_tokens > 0 and call >= 0:
            self._pending.append((call, event, host, num_worst_tokens))
        new_handle = DispatchHandle(rank_prefix, channel_prefix, recv_channel_offset, recv_src, in_rank_kept,
                                    send_head, status, num_tokens, num_recv, num_rows, num_channels, hidden,
                                    num_topk, num_experts_, buffer_id=id(self))
        if direct:
            if async_finish:
                self._used_by_comm_stream((*outs, *(x if fp8 else (x,)), topk_idx, topk_weights, in_rank_kept,
                                           *((layout.num_tokens_per_rank, layout.num_tokens_per_expert,
                                              layout.invalid_ids) if handle is None else ())))
        elif fw != "cupy":  # CuPy callers take the CuPy arrays as they are (FP8 stays uint8 storage)
            outs = (arrays.from_cupy(outs[0], fw, dtype="float8_e4m3fn" if fp8 else None, name="recv_x"),
                    arrays.from_cupy(outs[1], fw) if fp8 else None,
                    arrays.from_cupy(outs[2], fw) if outs[2] is not None else None,
                    arrays.from_cupy(outs[3], fw) if outs[3] is not None else None)
        result = DispatchResult(x=outs[0], x_scales=outs[1], topk_idx=outs[2], topk_weights=outs[3],
                                num_recv_tokens_per_expert=per_expert_counts, handle=new_handle, event=event)
        profile.mark("returned")
        return result

    # ------------------------------------------------------------------------------------------------ combine

    @_on_callers_stream
    def combine(self, y: Any, handle: DispatchHandle, topk_weights: Any = None, bias: Any = None,
                config: Config | None = None, previous_event: Event | None = None,
                async_finish: bool = False) -> CombineResult:
        """For each original token, the sum of the rows the ranks send back for it (+ bias): dispatch's adjoint."""
        self._check_normal()
        self._check_pending()
        profile = self._profile
        profile.start()
        dev = self.group.device
        if not isinstance(handle, DispatchHandle) or handle.buffer_id != id(self):
            raise ArgumentError(with_rank("handle must be the .handle of a dispatch of this Buffer"))
        y_info = arrays.check(y, "y", dtype="bfloat16", shape=(("rows", handle.num_rows), ("H", handle.hidden)),
                              shape_note="as the dispatch delivered", device=dev)
        y_arg = arrays.kernel_arg(y, y_info, "y")
        w_arg = None
        if topk_weights is not None:
            if handle.num_topk == 0:
                raise ArgumentError(with_rank("topk_weights given but the dispatch had no topk_idx"))
            w_info = arrays.check(topk_weights, "topk_weights", dtype="float32",
                                  shape=(("rows", handle.num_rows), ("K", handle.num_topk)), device=dev)
            w_arg = arrays.kernel_arg(topk_weights, w_info, "topk_weights")
        items: list[Any] = []
        biases: list[Any] = []
        if bias is not None:
            items = list(bias) if isinstance(bias, (tuple, list)) else [bias]
            if not 1 <= len(items) <= 2:
                raise ArgumentError(with_rank(f"bias must be one array or a pair, got {len(items)}"))
            for i, b in enumerate(items):
                b_info = arrays.check(b, f"bias[{i}]", dtype="bfloat16",
                                      shape=(("N", handle.num_tokens), ("H", handle.hidden)), device=dev)
                biases.append(arrays.kernel_arg(b, b_info, f"bias[{i}]"))
        base = config or self._combine_config
        if config is not None and config.num_channels != handle.num_channels:
            raise ArgumentError(with_rank(f"config.num_sms={config.num_sms} but combine replays the dispatch's "
                                          f"{handle.num_channels} SMs"))
        config = _channels_config(handle.num_channels, base.nvl_chunk_send, base.nvl_chunk_recv)
        need = _nvl_need(config, self.num_ranks, handle.hidden, handle.num_topk, 0, False)
        if need > self.num_nvl_bytes:
            raise ArgumentError(with_rank(f"this combine needs {need} bytes of NVLink buffer but the Buffer has "
                                          f"{self.num_nvl_bytes}: use Buffer.get_normal_size_hint(...)"))
        fw = y_info.framework
        direct = fw == "torch" and previous_event is None  # see _torch_outputs
        comm = self.comm_stream
        table = self.mem.table_ptr
        caller = self._begin(previous_event)
        profile.mark("validated", comm)
        if direct:
            out, out_w = self._torch_outputs(((handle.num_tokens, handle.hidden), "bfloat16"),
                                             ((handle.num_tokens, handle.num_topk), "float32")
                                             if w_arg is not None else None)
        else:
            cupy = _cupy()
            with comm:
                out = self._empty((handle.num_tokens, handle.hidden), _bf16())
                out_w = self._empty((handle.num_tokens, handle.num_topk), cupy.float32) if w_arg is not None \
                    else None
        grid = normal_grid(handle.num_channels, self._num_device_sms)
        self._main_module.launch(
            "intranode_combine", grid, NUM_THREADS, table, self._claims_ptrs[1], y_arg, 0 if w_arg is None else w_arg,
            biases[0] if biases else 0, biases[1] if len(biases) > 1 else 0, handle.rank_prefix_ints.ptr,
            handle.recv_channel_offset_ints.ptr, handle.send_head_ints.ptr, handle.status_ints.ptr, _address(out),
            _address(out_w), handle.num_tokens, handle.hidden, handle.num_topk, handle.num_channels,
            config.nvl_chunk_recv, config.nvl_chunk_send, profile.timeline("combine", grid, NORMAL_TIMELINE_POINTS),
            stream=comm)
        profile.mark("combine", comm)
        event = self._finish(caller, async_finish)
        if direct:
            if async_finish:
                self._used_by_comm_stream((out, out_w, y, topk_weights, *items))
        elif fw != "cupy":
            out = arrays.from_cupy(out, fw, name="combined_x")
            out_w = arrays.from_cupy(out_w, fw) if out_w is not None else None
        result = CombineResult(out, out_w, event)
        profile.mark("returned")
        return result

    # ------------------------------------------------------------------------------------------------ low latency

    @staticmethod
    def get_low_latency_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                  num_experts: int) -> int:
        """num_rdma_bytes (symmetric heap per rank) that low-latency mode needs for these sizes: two buffer sets."""
        return low_latency_size_hint(int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_ranks),
                                     int(num_experts))

    def _check_low_latency_args(self, num_rdma_bytes: int) -> int:
        """Validate a low-latency Buffer's sizes (the same on every rank); returns the heap bytes to reserve."""
        m, h, e, r = self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts, self.num_ranks
        self.group.check_same("Buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)", (m, h, e))
        if m <= 0 or h <= 0 or e <= 0:
            raise ArgumentError(with_rank(
                "low_latency_mode=True needs num_max_dispatch_tokens_per_rank, hidden and num_experts (> 0), got "
                f"{m}, {h}, {e}"))
        if e % r:
            raise ArgumentError(with_rank(f"num_experts={e} is not divisible by the {r} ranks (each rank owns "
                                          "num_experts / ranks experts)"))
        if h % 8:
            raise ArgumentError(with_rank(f"hidden={h} must be a multiple of 8 (16-byte rows)"))
        if dispatch_shared_bytes(h, m, LOW_LATENCY_MAX_TOPK, e) > MAX_DYNAMIC_SHARED_BYTES:
            raise ArgumentError(with_rank(
                f"num_max_dispatch_tokens_per_rank={m} with hidden={h} is too large for low-latency mode: each "
                f"dispatch block stages two tokens, every topk_idx entry and two ints an expert in shared memory "
                f"({dispatch_shared_bytes(h, m, LOW_LATENCY_MAX_TOPK, e)} bytes at top-{LOW_LATENCY_MAX_TOPK}, "
                f"{MAX_DYNAMIC_SHARED_BYTES} available)"))
        need = low_latency_size_hint(m, h, r, e)
        if num_rdma_bytes == 0:
            return need
        if num_rdma_bytes < need:
            raise ArgumentError(with_rank(
                f"num_rdma_bytes={num_rdma_bytes} is below the {need} bytes low-latency mode needs for "
                f"{m} tokens x hidden {h} x {e} experts on {r} ranks: use Buffer.get_low_latency_size_hint(...)"))
        return num_rdma_bytes

    def _low_latency(self) -> _LowLatencyState:
        self._check_open()
        if self._ll is None:
            raise EpjitError(with_rank("this Buffer was not made with low_latency_mode=True"))
        self._raise_low_latency_status()
        return self._ll

    def _raise_low_latency_status(self) -> None:
        """Raise, once, what earlier low-latency kernels found (their last block counts it in host_status)."""
        ll = self._ll
        if ll is None or ll.host_status.ints[0] == ll.status_seen[0]:
            return
        reports = ll.host_status.ints[0]  # read first: the kernel releases it after the counts
        counts = ll.host_status.ints[1:1 + STATUS_BIT_COUNT].copy()
        raised = counts != ll.status_seen[1:]
        ll.status_seen[0], ll.status_seen[1:] = reports, counts
        status = sum(1 << b for b in range(STATUS_BIT_COUNT) if raised[b])
        problems = []
        if status & STATUS_INVALID_IDS:
            problems.append(f"topk_idx had entries outside [-1, num_experts={self.num_experts}) (skipped)")
        if status & STATUS_SLOT_OVERFLOW:
            problems.append("one rank's topk_idx named one expert in more than "
                            f"num_max_dispatch_tokens_per_rank={self.num_max_dispatch_tokens_per_rank} slots "
                            "(repeated experts; the extra rows were dropped)")
        if status & STATUS_META_MISMATCH:
            problems.append("a rank dispatched with another hidden size or use_fp8 setting than this one")
        if status & STATUS_LAYOUT_TOO_BIG:
            problems.append("the kernels' buffer layout does not fit the symmetric heap (an epjit bug: "
                            "epjit/kernels/low_latency.py and cuda_src/low_latency.cuh disagree)")
        raise ArgumentError(with_rank("an earlier low-latency call was wrong, its results are not valid: "
                                      + "; ".join(problems)))

    def _low_latency_set(self, ll: _LowLatencyState, call: str) -> int:
        """The buffer set this call takes; refuses one whose earlier call still waits for its hook."""
        s = ll.next_set
        if ll.pending[s] is not None:
            raise ArgumentError(with_rank(
                f"low_latency_{call} would reuse buffer set {s}, whose {ll.pending[s]} has a receive hook that has "
                "not run: call that hook first (two calls may be in flight at most)"))
        ll.next_set ^= 1
        return s

    def _low_latency_hook(self, ll: _LowLatencyState, s: int, call: str, launch: Callable[[], None],
                          async_finish: bool, like: Any, then: Callable[[], None] | None = None) -> Callable[[], None]:
        """The receive half as a callable, run on the stream current when it is called (torch's, for torch
        arrays like ``like``, an array or a tuple led by one): so a hook called inside a CUDA-graph capture is
        captured there. The hook holds ``like`` until it runs."""
        ll.pending[s] = f"low_latency_{call}"
        ran = [False]

        def hook() -> None:
            if ran[0]:
                raise ArgumentError(with_rank(f"this low_latency_{call} hook already ran"))
            self._check_open()
            ran[0] = True
            with _callers_stream(like):
                caller = self._begin(None)
                with self.comm_stream:
                    launch()
                self._finish(caller, async_finish)
            ll.pending[s] = None
            if then is not None:
                then()

        return hook

    @_on_callers_stream
    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             return_recv_hook: bool = False, async_finish: bool = False,
                             cumulative_local_expert_recv_stats: Any = None) -> LowLatencyDispatchResult:
        """Send each (token, chosen expert) straight to a fixed slot of the expert's rank (DESIGN.md: low-latency
        dispatch). x is [N, H] bf16 with N <= num_max_dispatch_tokens_per_rank; topk_idx [N, K] int64, -1 = none.

        Returns x [L, R*max, H] (FP8 with x_scales [L, R*max, H/128], or bf16), recv_count [L], and a handle for
        low_latency_combine. With return_recv_hook the send half runs now and ``result.hook()`` runs the receive
        half; the arrays are valid after it.
        """
        ll = self._low_latency()
        dev = self.group.device
        m, hidden, e, r = self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts, self.num_ranks
        if num_max_dispatch_tokens_per_rank != m or num_experts != e:
            raise ArgumentError(with_rank(
                f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}, num_experts={num_experts}: "
                f"this Buffer was made for {m} and {e}"))
        x_info = arrays.check(x, "x", dtype="bfloat16", shape=("N", ("H", hidden)),
                              shape_note="with H the Buffer's hidden", device=dev)
        num_tokens = x_info.shape[0]
        if num_tokens > m:
            raise ArgumentError(with_rank(f"x has {num_tokens} tokens but num_max_dispatch_tokens_per_rank={m}"))
        k_info = arrays.check(topk_idx, "topk_idx", dtype="int64", shape=(("N", num_tokens), "K"),
                              shape_note="with N matching x", device=dev)
        num_topk = k_info.shape[1]
        if not 1 <= num_topk <= LOW_LATENCY_MAX_TOPK:
            raise ArgumentError(with_rank(f"topk_idx has {num_topk} columns; 1 to {LOW_LATENCY_MAX_TOPK} are "
                                          "supported in low-latency mode"))
        use_fp8, round_scale, use_ue8m0 = bool(use_fp8), bool(round_scale) or bool(use_ue8m0), bool(use_ue8m0)
        if not use_fp8 and round_scale:
            raise ArgumentError(with_rank("round_scale and use_ue8m0 need use_fp8=True"))
        if use_fp8 and hidden % 128:
            raise ArgumentError(with_rank(f"use_fp8=True needs hidden % 128 == 0, hidden={hidden}"))
        num_local = e // r
        stats_arg = 0
        if cumulative_local_expert_recv_stats is not None:
            s_info = arrays.check(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats",
                                  dtype="int32", shape=(num_local,), device=dev)
            stats_arg = arrays.kernel_arg(cumulative_local_expert_recv_stats, s_info,
                                          "cumulative_local_expert_recv_stats")
        x_arg, idx_arg = arrays.kernel_arg(x, x_info, "x"), arrays.kernel_arg(topk_idx, k_info, "topk_idx")
        s = self._low_latency_set(ll, "dispatch")
        self._profile.timelines = []
        rows = r * m
        num_scales = hidden // 128
        flags = (FLAG_FP8 if use_fp8 else 0) | (FLAG_ROUND_SCALE if round_scale else 0) | \
                (FLAG_UE8M0 if use_ue8m0 else 0)
        fw = x_info.framework
        direct = fw == "torch"  # torch outputs from torch's allocator (see _torch_outputs)
        caller = self._begin(None)
        specs = (((num_local, rows, hidden), "float8_e4m3fn" if use_fp8 else "bfloat16"),
                 ((num_local, rows, num_scales), "uint8" if use_ue8m0 else "float32") if use_fp8 else None,
                 ((num_local, rows), "int32"), ((num_local, rows), "int32"), ((num_local, r), "int64"),
                 ((num_local,), "int32"))
        if direct:
            outs = self._torch_outputs(*specs)
        else:
            with self.comm_stream:
                outs = tuple(None if spec is None else self._empty(spec[0], arrays.cupy_dtype(spec[1]))
                             for spec in specs)
        recv_x, recv_scales, src_info, topk_slot, layout_range, recv_count = outs
        shared = dispatch_shared_bytes(hidden, num_tokens, num_topk, e)

        def launch(phases: int) -> None:  # refers to the outputs: a pending hook keeps them alive
            ll.module.launch(
                "ll_dispatch", ll.num_sms, LOW_LATENCY_THREADS, self.mem.table_ptr, x_arg, idx_arg, num_tokens,
                num_topk, hidden, e, m, s, phases, flags, ll.force_puts, ll.sync_ptr, ll.host_status.device_ptr,
                *map(_address, outs), stats_arg,
                self._profile.timeline("ll_dispatch" + _PHASE_SUFFIX[phases], ll.num_sms, LL_TIMELINE_POINTS),
                shared_mem=shared, stream=self.comm_stream)

        launch(PHASE_SEND if return_recv_hook else PHASE_SEND | PHASE_RECV)
        event = self._finish(caller, async_finish)
        if direct and async_finish:
            self._used_by_comm_stream((*outs, x, topk_idx, cumulative_local_expert_recv_stats))

        def public(arr: Any, **kw: Any) -> Any:
            return arr if direct or arr is None else arrays.from_cupy(arr, fw, **kw)

        handle = LowLatencyHandle(public(src_info), public(layout_range), m, hidden, e, num_topk, src_info,
                                  layout_range, topk_slot, buffer_id=id(self), pending=[bool(return_recv_hook)])
        hook = None
        if return_recv_hook:
            def done() -> None:
                handle.pending[0] = False

            hook = self._low_latency_hook(ll, s, "dispatch", lambda: launch(PHASE_RECV), async_finish, x, done)
        return LowLatencyDispatchResult(
            x=public(recv_x, dtype="float8_e4m3fn" if use_fp8 else None, name="recv_x"),
            x_scales=public(recv_scales), recv_count=public(recv_count), handle=handle, event=event, hook=hook)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> Any:
        """A [L, R*max, H] bf16 array for the expert outputs of the next low_latency_combine (zero_copy=True).

        epjit's combine reads y in place wherever it lives, so this saves no copy: it exists so DeepEP code runs
        unchanged. Two arrays alternate with the buffer sets (allocated on first use).
        """
        ll = self._low_latency()
        self._check_ll_handle(handle)
        s = ll.next_set
        if ll.combine_buffers[s] is None:
            cupy = _cupy()
            with self._device:
                shape = (self.num_experts // self.num_ranks, self.num_ranks * handle.num_max_dispatch_tokens_per_rank,
                         handle.hidden)
                import ml_dtypes

                ll.combine_buffers[s] = cupy.empty(shape, dtype=ml_dtypes.bfloat16)
        return arrays.from_cupy(ll.combine_buffers[s], arrays.describe(handle.src_info, "handle.src_info").framework)

    def _check_ll_handle(self, handle: LowLatencyHandle) -> None:
        if not isinstance(handle, LowLatencyHandle) or handle.buffer_id != id(self):
            raise ArgumentError(with_rank("handle must be the .handle of a low_latency_dispatch of this Buffer"))
        if handle.pending[0]:
            raise ArgumentError(with_rank("the dispatch of this handle has a receive hook that has not run: "
                                          "call its hook() first"))

    @_on_callers_stream
    def low_latency_combine(self, y: Any, topk_idx: Any, topk_weights: Any, handle: LowLatencyHandle,
                            zero_copy: bool = False, out: Any = None, return_recv_hook: bool = False,
                            async_finish: bool = False) -> LowLatencyCombineResult:
        """For each token: sum over k with topk_idx[t, k] >= 0 of topk_weights[t, k] * (expert output of the row
        that answered (t, k)), in float32, as bf16 [N, H] (DESIGN.md: low-latency combine).

        y is [L, R*max, H] bf16 in the layout the dispatch delivered; topk_idx/topk_weights are what this rank
        dispatched with. ``out`` receives the result if given.
        """
        ll = self._low_latency()
        self._check_ll_handle(handle)
        dev = self.group.device
        m, hidden, e, r = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts, self.num_ranks
        num_local = e // r
        y_info = arrays.check(y, "y", dtype="bfloat16", shape=(num_local, r * m, hidden),
                              shape_note="as the dispatch delivered", device=dev)
        k_info = arrays.check(topk_idx, "topk_idx", dtype="int64", shape=("N", ("K", handle.num_topk)),
                              shape_note="as dispatched", device=dev)
        num_tokens = k_info.shape[0]
        if num_tokens > m:
            raise ArgumentError(with_rank(f"topk_idx has {num_tokens} tokens but num_max_dispatch_tokens_per_rank={m}"))
        w_info = arrays.check(topk_weights, "topk_weights", dtype="float32",
                              shape=(("N", num_tokens), ("K", handle.num_topk)), shape_note="matching topk_idx",
                              device=dev)
        y_arg = arrays.kernel_arg(y, y_info, "y")
        if zero_copy and not any(b is not None and b.data.ptr == _arg_address(y_arg) for b in ll.combine_buffers):
            raise ArgumentError(with_rank("zero_copy=True needs y from get_next_low_latency_combine_buffer(handle)"))
        idx_arg = arrays.kernel_arg(topk_idx, k_info, "topk_idx")
        w_arg = arrays.kernel_arg(topk_weights, w_info, "topk_weights")
        out_arg = None
        if out is not None:
            o_info = arrays.check(out, "out", dtype="bfloat16", shape=(("N", num_tokens), ("H", hidden)), device=dev)
            out_arg = arrays.kernel_arg(out, o_info, "out")
        fw = y_info.framework
        direct = fw == "torch"  # torch output from torch's allocator (see _torch_outputs)
        s = self._low_latency_set(ll, "combine")
        self._profile.timelines = []
        caller = self._begin(None)
        if out is None:
            if direct:
                (out_arg,) = self._torch_outputs(((num_tokens, hidden), "bfloat16"))
            else:
                with self.comm_stream:
                    out_arg = self._empty((num_tokens, hidden), _bf16())

        def launch(phases: int) -> None:  # refers to the output: a pending hook keeps it alive
            ll.module.launch(
                "ll_combine", ll.num_sms, LOW_LATENCY_THREADS, self.mem.table_ptr, y_arg,
                _address(handle.src_info_dev), _address(handle.topk_slot), _address(handle.layout_range_dev),
                idx_arg, w_arg, _arg_address(out_arg), num_tokens, handle.num_topk, hidden, e, m, s, phases,
                ll.force_puts, ll.sync_ptr, ll.host_status.device_ptr,
                self._profile.timeline("ll_combine" + _PHASE_SUFFIX[phases], ll.num_sms, LL_TIMELINE_POINTS),
                stream=self.comm_stream)

        launch(PHASE_SEND if return_recv_hook else PHASE_SEND | PHASE_RECV)
        event = self._finish(caller, async_finish)
        if direct and async_finish:
            self._used_by_comm_stream((out_arg, y, topk_idx, topk_weights))
        # The receive half reads topk_idx and topk_weights (by address): the hook holds them until it runs.
        hook = self._low_latency_hook(ll, s, "combine", lambda: launch(PHASE_RECV), async_finish,
                                      (y, topk_idx, topk_weights)) if return_recv_hook else None
        if out is not None:
            result_x = out
        elif direct:
            result_x = out_arg
        else:
            result_x = arrays.from_cupy(out_arg, fw, name="combined_x")
        return LowLatencyCombineResult(result_x, event, hook)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int | None = None, hidden: int | None = None,
                                 num_experts: int | None = None) -> None:
        """Collective: forget every low-latency call (epochs, signals, pending hooks), e.g. after an error that
        left ranks out of step. Every rank must call it, with no low-latency work in flight. The sizes, if given
        (DeepEP's signature), must be the Buffer's."""
        ll = self._ll
        if ll is None:
            raise EpjitError(with_rank("this Buffer was not made with low_latency_mode=True"))
        given = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        mine = (self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)
        if any(g is not None and g != m for g, m in zip(given, mine, strict=True)):
            raise ArgumentError(with_rank(f"clean_low_latency_buffer{given}: this Buffer was made for {mine} "
                                          "(num_max_dispatch_tokens_per_rank, hidden, num_experts)"))
        self._sync()
        self.group.barrier()
        cupy = _cupy()
        with self._device:
            ll.sync.fill(0)
            heap = self.mem.sym
            assert heap is not None
            cupy.cuda.runtime.memset(heap.base, 0, low_latency_size_hint(
                self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_ranks, self.num_experts))
            cupy.cuda.runtime.deviceSynchronize()
        ll.host_status.ints[:] = 0  # no kernel runs: the synchronisation above
        ll.status_seen[:] = 0
        ll.next_set = 0
        ll.pending = [None, None]
        self.group.barrier()

    # ------------------------------------------------------------------------------------------------ misc

    def barrier(self) -> None:
        """A device-side barrier of every rank of the NVLink node, on the communication stream (waits for it)."""
        self._check_open()
        from .kernels import BarrierSpec

        module = jit.load(BarrierSpec(self.group.num_nvl_ranks), self.group.device)
        module.launch("nvl_barrier", 1, 32, self.mem.table_ptr, stream=self.comm_stream)
        self._sync()

    def synchronize(self) -> None:
        """Wait for all of this Buffer's work; raises EpjitTimeoutError if a kernel gave up waiting, and what a
        refused or wrong earlier call found that no call has raised yet."""
        self._sync()
        self._check_pending()
        self._raise_low_latency_status()


__all__ = ["Buffer", "CombineResult", "Config", "DispatchHandle", "DispatchLayout", "DispatchResult", "Event",
           "LowLatencyCombineResult", "LowLatencyDispatchResult", "LowLatencyHandle"]
