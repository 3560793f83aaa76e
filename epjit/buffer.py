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

import contextlib
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from . import arrays, jit
from .config import Config, get_combine_config, get_dispatch_config, normal_size_hint
from .env import settings
from .errors import ArgumentError, ArgumentTypeError, EpjitError, SetupError, with_rank
from .group import Group
from .kernels import IntranodeNotifySpec, IntranodeSpec, LayoutSpec
from .kernels.intranode import NUM_THREADS, intranode_min_nvl_bytes
from .memory import MappedHostArray, PeerMemory

# Bits of the notify status (cuda_src/intranode.cu) and of the meta flags each rank announces.
_STATUS_META_MISMATCH, _STATUS_WORST_TOO_SMALL, _STATUS_LAYOUT_TOO_BIG, _STATUS_INVALID_IDS = 1, 2, 4, 8
_META_INVALID_IDS, _META_LAYOUT_TOO_BIG = 1 << 29, 1 << 30
_FLAG_FP8, _FLAG_WEIGHTS, _FLAG_TOPK = 1, 2, 4
_META_NAMES = ("hidden", "num_experts", "num_topk", "flags")
_MAX_CHANNELS = 64  # what every Buffer reserves control words for (num_sms <= 128)
_POISON_BYTE = 0x7F  # NaN in bf16 pairs (0x7F7F), NaN in e4m3, a huge int: never a plausible value


def _cupy() -> Any:
    import cupy

    return cupy


def _callers_stream(obj: Any) -> Any:
    """A context that makes CuPy's current stream the caller's: torch's current stream for torch tensors (so a
    call inside a torch side stream or a torch CUDA-graph capture is ordered, and captured, where the caller's
    work is); CuPy's own current stream otherwise (JAX and CuPy callers)."""
    if isinstance(obj, (tuple, list)) and obj:
        obj = obj[0]
    if not type(obj).__module__.startswith("torch"):
        return contextlib.nullcontext()
    torch = sys.modules["torch"]
    stream = torch.cuda.current_stream()
    if stream.cuda_stream == 0:
        return contextlib.nullcontext()  # torch's legacy default stream is CuPy's null stream
    return _cupy().cuda.ExternalStream(stream.cuda_stream, stream.device.index)


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


class _Profile:
    """Host timestamps and stream events of the last call, when EPJIT_PROFILE=1 (off: every method is a no-op)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.marks: list[tuple[str, float, Any]] = []

    def start(self) -> None:
        if self.enabled:
            self.marks = [("start", time.perf_counter(), None)]

    def mark(self, name: str, stream: Any = None) -> None:
        if self.enabled:
            self.marks.append((name, time.perf_counter(), stream.record() if stream is not None else None))

    def report(self) -> dict[str, float]:
        """Microseconds: host time from the call's start to each mark, and GPU time between recorded events."""
        out: dict[str, float] = {}
        if not self.marks:
            return out
        t0 = self.marks[0][1]
        last_event = None
        for name, t, event in self.marks[1:]:
            out[f"host:{name}"] = round((t - t0) * 1e6, 1)
            if event is not None:
                event.synchronize()
                if last_event is not None:
                    out[f"gpu:{name}"] = round(_cupy().cuda.get_elapsed_time(last_event, event) * 1e3, 1)
                last_event = event
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
    # The CuPy arrays behind the four above when get_dispatch_layout made them: dispatch skips re-importing them.
    cupy_arrays: tuple[Any, ...] | None = field(default=None, repr=False)


@dataclass
class DispatchHandle:
    """Everything combine (and a cached dispatch) needs to replay a routing. Arrays are CuPy, on this GPU."""

    rank_prefix_matrix: Any  # [R, R] int32: [i, j] = tokens ranks 0..i send to rank j
    channel_prefix_matrix: Any  # [R, C] int32: tokens of my channels 0..c bound for rank r
    recv_channel_offset: Any  # [R, C] int32: first received row of (source rank, channel)
    recv_src_idx: Any  # [rows] int32: source token index of each received row
    is_token_in_rank: Any  # [N, R] bool
    send_head: Any  # [N, R] int32: ring index token t took towards r (or -(next index)-1)
    num_tokens: int
    num_recv_tokens: int  # -1 when unknown to the host (worst-token mode)
    num_rows: int  # rows of the dispatched arrays
    num_channels: int
    hidden: int
    num_topk: int
    num_experts: int
    buffer_id: int = field(default=0, repr=False)


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


class Buffer:
    """Peer memory, streams and kernels for expert-parallel dispatch/combine (a collective object: every rank of
    the group constructs and closes it together)."""

    def __init__(self, group: Group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_max_dispatch_tokens_per_rank: int = 0, hidden: int = 0, num_experts: int = 0) -> None:
        if not isinstance(group, Group):
            raise ArgumentTypeError(with_rank(f"group must be what epjit.init() returns, got {type(group).__name__}"))
        group.check_same("Buffer(num_nvl_bytes, num_rdma_bytes, low_latency_mode)",
                         (int(num_nvl_bytes), int(num_rdma_bytes), bool(low_latency_mode)))
        if low_latency_mode:
            raise SetupError(with_rank("low_latency_mode=True is not available yet: epjit has the normal "
                                       "(intranode) mode only in this version"))
        if group.num_nvl_ranks != group.size:
            raise SetupError(with_rank(
                f"normal mode across NVLink nodes is not available yet ({group.size} ranks in nodes of "
                f"{group.num_nvl_ranks}): use one NVLink node (num_nvl_ranks = size)"))
        if group.device is None:
            raise SetupError(with_rank("epjit.Buffer needs a GPU, and epjit.init() bound none on this rank"))
        minimum = intranode_min_nvl_bytes(group.size, _MAX_CHANNELS)
        if num_nvl_bytes < minimum:
            raise ArgumentError(with_rank(
                f"num_nvl_bytes={num_nvl_bytes} is below the {minimum} bytes of control words every call needs; "
                f"Buffer.get_normal_size_hint(...) gives a size for given shapes"))
        self.group = group
        self.num_ranks = group.size
        self.rank = group.rank
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.hidden = int(hidden)
        self.num_experts = int(num_experts)
        cupy = _cupy()
        self._device = cupy.cuda.Device(group.device)
        self.mem = PeerMemory.create(group, self.num_nvl_bytes, int(num_rdma_bytes))
        try:
            with self._device:
                self.comm_stream = cupy.cuda.Stream(non_blocking=True)
                self._device_status = cupy.zeros(1, dtype=cupy.int32)
            self._host_out: MappedHostArray | None = None
            self._pending_status: tuple[Event, int] | None = None  # worst-token notify not yet checked
            self._layout_module = jit.load(LayoutSpec(), group.device)
            self._notify_module = jit.load(IntranodeNotifySpec(self.num_ranks), group.device)
            self._main_module = jit.load(IntranodeSpec(self.num_ranks, NUM_THREADS), group.device)
        except BaseException:
            self.mem.close()
            raise
        self._closed = False
        self._settings = settings()  # read once: the environment is not re-read on the hot path
        self._profile = _Profile(self._settings.profile)

    def profile(self) -> dict[str, float]:
        """Where the last dispatch/combine spent its time (needs EPJIT_PROFILE=1; waits for that call's work)."""
        return self._profile.report()

    # ------------------------------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Collective: wait for this Buffer's work, then release the peer memory on every rank."""
        if self._closed:
            return
        self._closed = True
        try:
            self.mem.synchronize(self.comm_stream)
        finally:
            if self._host_out is not None:
                self._host_out.close()
            self.mem.close()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def get_normal_size_hint(num_ranks: int, hidden: int, num_topk: int = 8, num_experts: int = 256,
                             config: Config | None = None) -> int:
        """num_nvl_bytes for normal-mode dispatch and combine of these sizes with the default (or given) config."""
        return max(normal_size_hint(num_ranks, hidden, num_topk, num_experts, config),
                   intranode_min_nvl_bytes(num_ranks, _MAX_CHANNELS))

    # ------------------------------------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise EpjitError(with_rank("this Buffer is closed"))

    def _host_buffer(self, num_experts: int) -> MappedHostArray:
        need = 4 * (2 + 5 * self.num_ranks + num_experts // self.num_ranks)
        if self._host_out is None or self._host_out.num_bytes < need:
            if self._host_out is not None:
                self.comm_stream.synchronize()
                self._host_out.close()
            self._host_out = MappedHostArray(max(need, 4096))
        return self._host_out

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
            self.comm_stream.wait_event(caller.record())
        return caller

    def _finish(self, caller: Any, async_finish: bool) -> Event:
        event = Event(self.comm_stream.record())
        if not async_finish:
            caller.wait_event(event.event)
        return event

    def _sync(self) -> None:
        """Wait for the communication stream; a kernel timeout becomes EpjitTimeoutError."""
        self.mem.synchronize(self.comm_stream)

    def _empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        cupy = _cupy()
        out = cupy.empty(shape, dtype=dtype)
        if self._settings.poison_outputs and out.size:
            out.view(cupy.uint8).fill(_POISON_BYTE)
        return out

    def _check_status(self, host: MappedHostArray, num_worst_tokens: int) -> None:
        ints = host.view(np.int32)
        status = int(ints[1])
        if status == 0:
            return
        r = self.num_ranks
        meta = ints[2:2 + 4 * r].reshape(r, 4).copy()
        totals = ints[2 + 4 * r:2 + 5 * r].copy()
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
                column = meta[:, j] & ~(_META_INVALID_IDS | _META_LAYOUT_TOO_BIG)
                if len(set(column.tolist())) > 1:
                    values = ", ".join(f"rank {i}: {self._describe_meta(name, int(v))}" for i, v in enumerate(column))
                    problems.append(f"{name} differs across ranks: {values}")
        if status & _STATUS_WORST_TOO_SMALL:
            values = ", ".join(f"rank {i}: {int(v)}" for i, v in enumerate(totals))
            problems.append(f"num_worst_tokens={num_worst_tokens} is too small for what arrives ({values})")
        raise ArgumentError(with_rank("dispatch refused on every rank: " + "; ".join(problems)))

    @staticmethod
    def _describe_meta(name: str, value: int) -> str:
        if name != "flags":
            return str(value)
        parts = [("FP8" if value & _FLAG_FP8 else "bf16"), ("weights" if value & _FLAG_WEIGHTS else "no weights"),
                 ("topk_idx" if value & _FLAG_TOPK else "no topk_idx")]
        return "/".join(parts)

    def _check_pending(self) -> None:
        """Raise what an earlier worst-token dispatch's notify found, once its stream got there."""
        if self._pending_status is None or _capturing():
            return
        event, num_worst_tokens = self._pending_status
        if not event.event.done:
            return
        self._pending_status = None
        assert self._host_out is not None
        self._check_status(self._host_out, num_worst_tokens)

    # ------------------------------------------------------------------------------------------------ layout

    @_on_callers_stream
    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Event | None = None,
                            async_finish: bool = False) -> DispatchLayout:
        """Counts per rank and per expert, and is_token_in_rank, for topk_idx [N, K] int64 (-1 = no expert)."""
        self._check_open()
        cupy = _cupy()
        info = arrays.check(topk_idx, "topk_idx", dtype="int64", ndim=2, device=self.group.device)
        num_experts = self._check_num_experts(num_experts)
        idx = arrays.to_cupy(topk_idx, "topk_idx")
        num_tokens, num_topk = info.shape
        caller = self._begin(previous_event)
        with self.comm_stream:
            per_rank = cupy.zeros(self.num_ranks, dtype=cupy.int32)
            per_expert = cupy.zeros(num_experts, dtype=cupy.int32)
            in_rank = cupy.zeros((num_tokens, self.num_ranks), dtype=cupy.bool_)
            invalid = cupy.zeros(1, dtype=cupy.int32)
            if num_tokens:
                block = 256
                shared = 4 * (num_experts + 2 * self.num_ranks)
                self._layout_module.launch("dispatch_layout", (num_tokens + block - 1) // block, block, idx,
                                           num_tokens, num_topk, num_experts, self.num_ranks, self.num_ranks,
                                           per_rank, None, per_expert, in_rank, invalid, shared_mem=shared,
                                           stream=self.comm_stream)
        event = self._finish(caller, async_finish)
        fw = info.framework
        layout = DispatchLayout(arrays.from_cupy(per_rank, fw), None, arrays.from_cupy(per_expert, fw),
                                arrays.from_cupy(in_rank, fw), event, invalid_ids=invalid)
        layout.cupy_arrays = (layout.num_tokens_per_rank, layout.num_tokens_per_expert, layout.is_token_in_rank,
                              per_rank, per_expert, in_rank)
        return layout

    def _layout_arrays(self, layout: DispatchLayout, num_tokens: int) -> tuple[Any, Any, Any]:
        """CuPy views of a layout's arrays, validated (or taken as made, if get_dispatch_layout made them)."""
        made = layout.cupy_arrays
        if made is not None and made[0] is layout.num_tokens_per_rank and made[1] is layout.num_tokens_per_expert \
                and made[2] is layout.is_token_in_rank and made[5].shape[0] == num_tokens:
            return made[3], made[4], made[5]
        dev = self.group.device
        arrays.check(layout.num_tokens_per_rank, "layout.num_tokens_per_rank", dtype="int32",
                     shape=(self.num_ranks,), device=dev)
        arrays.check(layout.num_tokens_per_expert, "layout.num_tokens_per_expert", dtype="int32", ndim=1, device=dev)
        arrays.check(layout.is_token_in_rank, "layout.is_token_in_rank", dtype="bool",
                     shape=(("N", num_tokens), self.num_ranks), shape_note="with N matching x", device=dev)
        return (arrays.to_cupy(layout.num_tokens_per_rank, "layout.num_tokens_per_rank"),
                arrays.to_cupy(layout.num_tokens_per_expert, "layout.num_tokens_per_expert"),
                arrays.to_cupy(layout.is_token_in_rank, "layout.is_token_in_rank"))

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
        """
        self._check_open()
        self._check_pending()
        self._profile.start()
        cupy = _cupy()
        dev = self.group.device
        # ---- validate everything before any kernel runs
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ArgumentError(with_rank(f"x must be an array or a pair (x_fp8, scales), got {len(x)} items"))
            x_info = arrays.check(x[0], "x", dtype="float8_e4m3fn", ndim=2, device=dev)
            num_tokens, hidden = x_info.shape
            if hidden % 128:
                raise ArgumentError(with_rank(f"FP8 x has hidden={hidden}, which is not a multiple of 128"))
            arrays.check(x[1], "x_scales", dtype="float32", shape=(("N", num_tokens), hidden // 128),
                         shape_note="with N matching x and one scale per 128 channels", device=dev)
            x_arr, scales_arr, fp8 = arrays.to_cupy(x[0], "x"), arrays.to_cupy(x[1], "x_scales"), True
        else:
            x_info = arrays.check(x, "x", dtype="bfloat16", ndim=2, device=dev)
            num_tokens, hidden = x_info.shape
            x_arr, scales_arr, fp8 = arrays.to_cupy(x, "x"), None, False
        if hidden % 8 or hidden <= 0:
            raise ArgumentError(with_rank(f"hidden={hidden} must be a positive multiple of 8 (16-byte rows)"))
        idx_arr = w_arr = None
        num_topk = 0
        if topk_idx is not None:
            k_info = arrays.check(topk_idx, "topk_idx", dtype="int64", shape=(("N", num_tokens), "K"),
                                  shape_note="with N matching x", device=dev)
            num_topk = k_info.shape[1]
            idx_arr = arrays.to_cupy(topk_idx, "topk_idx")
            if not 1 <= num_topk <= 32:
                raise ArgumentError(with_rank(f"topk_idx has {num_topk} columns; 1 to 32 are supported"))
        if topk_weights is not None:
            if topk_idx is None:
                raise ArgumentError(with_rank("topk_weights given without topk_idx"))
            arrays.check(topk_weights, "topk_weights", dtype="float32", shape=(("N", num_tokens), ("K", num_topk)),
                         shape_note="matching topk_idx", device=dev)
            w_arr = arrays.to_cupy(topk_weights, "topk_weights")
        for name, value in (("num_worst_tokens", num_worst_tokens), ("expert_alignment", expert_alignment)):
            if not isinstance(value, (int, np.integer)) or value < (0 if name == "num_worst_tokens" else 1):
                raise ArgumentError(with_rank(f"{name} must be an int >= {0 if name == 'num_worst_tokens' else 1}, "
                                              f"got {value!r}"))
        num_worst_tokens, expert_alignment = int(num_worst_tokens), int(expert_alignment)

        if handle is not None:
            if not isinstance(handle, DispatchHandle) or handle.buffer_id != id(self):
                raise ArgumentError(with_rank("handle must come from a dispatch of this Buffer"))
            if handle.num_tokens != num_tokens or handle.hidden != hidden:
                raise ArgumentError(with_rank(f"x is [{num_tokens}, {hidden}] but the handle was made for "
                                              f"[{handle.num_tokens}, {handle.hidden}]"))
            num_experts_ = handle.num_experts
            if idx_arr is not None and num_topk != handle.num_topk:
                raise ArgumentError(with_rank(f"topk_idx has {num_topk} columns, the handle {handle.num_topk}"))
            num_channels = handle.num_channels
            if config is not None and config.num_channels != num_channels:
                raise ArgumentError(with_rank(f"config.num_sms={config.num_sms} but the handle was made with "
                                              f"{2 * num_channels} SMs"))
            config = config or get_dispatch_config(self.num_ranks)
            config = Config(2 * num_channels, config.nvl_chunk_send, config.nvl_chunk_recv)
        else:
            config = config or get_dispatch_config(self.num_ranks)
            if not isinstance(config, Config):
                raise ArgumentTypeError(with_rank(f"config must be an epjit.Config, got {type(config).__name__}"))
            num_channels = config.num_channels
            if layout is None:
                if idx_arr is None:
                    raise ArgumentError(with_rank("dispatch needs layout=get_dispatch_layout(...), or topk_idx, "
                                                  "or a handle"))
                ne = num_experts if num_experts is not None else self.num_experts
                if not ne:
                    raise ArgumentError(with_rank("dispatch without a layout needs num_experts (here or on the "
                                                  "Buffer) to compute one"))
                layout = self.get_dispatch_layout(topk_idx, ne)
            elif not isinstance(layout, DispatchLayout):
                raise ArgumentTypeError(with_rank(f"layout must be a DispatchLayout, got {type(layout).__name__}"))
            layout_cupy = self._layout_arrays(layout, num_tokens)
            num_experts_ = self._check_num_experts(int(layout_cupy[1].shape[0]))
        if config.nvl_bytes(self.num_ranks, hidden, num_topk, num_experts_, fp8) > self.num_nvl_bytes:
            # Every rank computes the same need from the same (checked-in-notify) sizes, so all raise together
            # when the sizes agree; when they do not, notify reports the mismatch on every rank.
            need = config.nvl_bytes(self.num_ranks, hidden, num_topk, num_experts_, fp8)
            raise ArgumentError(with_rank(
                f"this dispatch needs {need} bytes of NVLink buffer (hidden={hidden}, top-{num_topk}, "
                f"{num_experts_} experts, {config}) but the Buffer has {self.num_nvl_bytes}: use "
                "Buffer.get_normal_size_hint(...)"))

        flags = (_FLAG_FP8 if fp8 else 0) | (_FLAG_WEIGHTS if w_arr is not None else 0) | \
                (_FLAG_TOPK if idx_arr is not None else 0)
        num_scales = hidden // 128 if fp8 else 0
        r = self.num_ranks
        host = self._host_buffer(num_experts_)
        caller = self._begin(previous_event)
        self._profile.mark("validated", self.comm_stream)
        with self.comm_stream:
            if handle is None:
                per_rank, per_expert, in_rank = layout_cupy
                rank_prefix = cupy.empty((r, r), dtype=cupy.int32)
                channel_prefix = cupy.empty((r, num_channels), dtype=cupy.int32)
                invalid = layout.invalid_ids
            else:
                in_rank, rank_prefix, channel_prefix = (handle.is_token_in_rank, handle.rank_prefix_matrix,
                                                        handle.channel_prefix_matrix)
                per_rank = per_expert = invalid = None
            host.view(np.int32)[:2] = (-1, 0)
            self._notify_module.launch(
                "intranode_notify", 1 + r, 128, self.mem.table_ptr, per_rank, per_expert, in_rank, num_tokens,
                num_channels, config.nvl_chunk_recv, hidden, num_topk, num_scales, num_experts_, flags,
                expert_alignment, num_worst_tokens, int(handle is not None), invalid, rank_prefix, channel_prefix,
                host.device_ptr, self._device_status, stream=self.comm_stream)
            self._profile.mark("notify", self.comm_stream)
            if num_worst_tokens > 0:
                num_rows, num_recv, per_expert_counts = num_worst_tokens, -1, []
            else:
                self._sync()
                self._check_status(host, 0)
                ints = host.view(np.int32)
                num_recv = int(ints[0])
                num_rows = num_recv
                if handle is not None:
                    per_expert_counts = []
                    if handle.num_recv_tokens >= 0 and num_recv != handle.num_recv_tokens:
                        raise EpjitError(with_rank(f"cached dispatch received {num_recv} rows, the handle says "
                                                   f"{handle.num_recv_tokens}"))
                else:
                    lo = 2 + 5 * r
                    per_expert_counts = [int(v) for v in ints[lo:lo + num_experts_ // r]]
                self._profile.mark("host_synced")

            # ---- outputs (on the caller's side of the allocator: they are the caller's arrays)
            recv_x = self._empty((num_rows, hidden), cupy.uint8 if fp8 else x_arr.dtype)
            recv_scales = self._empty((num_rows, num_scales), cupy.float32) if fp8 else None
            recv_src = self._empty((num_rows,), cupy.int32)
            recv_idx = self._empty((num_rows, num_topk), cupy.int64) if idx_arr is not None else None
            recv_w = self._empty((num_rows, num_topk), cupy.float32) if w_arr is not None else None
            recv_channel_offset = cupy.empty((r, num_channels), dtype=cupy.int32)
            send_head = cupy.empty((num_tokens, r), dtype=cupy.int32)
            self._profile.mark("allocated", self.comm_stream)
            self._main_module.launch(
                "intranode_dispatch", 2 * num_channels, NUM_THREADS, self.mem.table_ptr, x_arr, scales_arr, idx_arr,
                w_arr, in_rank, channel_prefix, rank_prefix, self._device_status, recv_x, recv_scales, recv_src,
                recv_idx, recv_w, recv_channel_offset, send_head, num_tokens, hidden,
                hidden * x_arr.dtype.itemsize // 16, num_scales, num_topk, num_experts_, num_channels,
                config.nvl_chunk_recv, config.nvl_chunk_send, num_worst_tokens, stream=self.comm_stream)
            self._profile.mark("dispatch", self.comm_stream)
        event = self._finish(caller, async_finish)
        if num_worst_tokens > 0 and not _capturing():
            self._pending_status = (event, num_worst_tokens)
        new_handle = DispatchHandle(rank_prefix, channel_prefix, recv_channel_offset, recv_src, in_rank, send_head,
                                    num_tokens, num_recv, num_rows, num_channels, hidden, num_topk, num_experts_,
                                    buffer_id=id(self))
        fw = x_info.framework
        result = DispatchResult(
            x=arrays.from_cupy(recv_x, fw, dtype="float8_e4m3fn" if fp8 else None, name="recv_x"),
            x_scales=arrays.from_cupy(recv_scales, fw) if fp8 else None,
            topk_idx=arrays.from_cupy(recv_idx, fw) if recv_idx is not None else None,
            topk_weights=arrays.from_cupy(recv_w, fw) if recv_w is not None else None,
            num_recv_tokens_per_expert=per_expert_counts, handle=new_handle, event=event)
        self._profile.mark("returned")
        return result

    # ------------------------------------------------------------------------------------------------ combine

    @_on_callers_stream
    def combine(self, y: Any, handle: DispatchHandle, topk_weights: Any = None, bias: Any = None,
                config: Config | None = None, previous_event: Event | None = None,
                async_finish: bool = False) -> CombineResult:
        """For each original token, the sum of the rows the ranks send back for it (+ bias): dispatch's adjoint."""
        self._check_open()
        self._check_pending()
        self._profile.start()
        cupy = _cupy()
        dev = self.group.device
        if not isinstance(handle, DispatchHandle) or handle.buffer_id != id(self):
            raise ArgumentError(with_rank("handle must be the .handle of a dispatch of this Buffer"))
        y_info = arrays.check(y, "y", dtype="bfloat16", shape=(("rows", handle.num_rows), ("H", handle.hidden)),
                              shape_note="as the dispatch delivered", device=dev)
        y_arr = arrays.to_cupy(y, "y")
        w_arr = None
        if topk_weights is not None:
            if handle.num_topk == 0:
                raise ArgumentError(with_rank("topk_weights given but the dispatch had no topk_idx"))
            arrays.check(topk_weights, "topk_weights", dtype="float32",
                         shape=(("rows", handle.num_rows), ("K", handle.num_topk)), device=dev)
            w_arr = arrays.to_cupy(topk_weights, "topk_weights")
        biases: list[Any] = []
        if bias is not None:
            items = list(bias) if isinstance(bias, (tuple, list)) else [bias]
            if not 1 <= len(items) <= 2:
                raise ArgumentError(with_rank(f"bias must be one array or a pair, got {len(items)}"))
            for i, b in enumerate(items):
                arrays.check(b, f"bias[{i}]", dtype="bfloat16",
                             shape=(("N", handle.num_tokens), ("H", handle.hidden)), device=dev)
                biases.append(arrays.to_cupy(b, f"bias[{i}]"))
        base = config or get_combine_config(self.num_ranks)
        if config is not None and config.num_channels != handle.num_channels:
            raise ArgumentError(with_rank(f"config.num_sms={config.num_sms} but combine replays the dispatch's "
                                          f"{2 * handle.num_channels} SMs"))
        config = Config(2 * handle.num_channels, base.nvl_chunk_send, base.nvl_chunk_recv)
        need = config.nvl_bytes(self.num_ranks, handle.hidden, handle.num_topk, 0, False)
        if need > self.num_nvl_bytes:
            raise ArgumentError(with_rank(f"this combine needs {need} bytes of NVLink buffer but the Buffer has "
                                          f"{self.num_nvl_bytes}: use Buffer.get_normal_size_hint(...)"))
        caller = self._begin(previous_event)
        self._profile.mark("validated", self.comm_stream)
        with self.comm_stream:
            out = self._empty((handle.num_tokens, handle.hidden), y_arr.dtype)
            out_w = self._empty((handle.num_tokens, handle.num_topk), cupy.float32) if w_arr is not None else None
            self._notify_module.launch("intranode_combine_prepare", 1, 128, self.mem.table_ptr, handle.num_channels,
                                       stream=self.comm_stream)
            self._profile.mark("prepare", self.comm_stream)
            self._main_module.launch(
                "intranode_combine", 2 * handle.num_channels, NUM_THREADS, self.mem.table_ptr, y_arr, w_arr,
                biases[0] if biases else None, biases[1] if len(biases) > 1 else None, handle.rank_prefix_matrix,
                handle.recv_channel_offset, handle.send_head, out, out_w, handle.num_tokens, handle.hidden,
                handle.num_topk, handle.num_channels, config.nvl_chunk_recv, config.nvl_chunk_send,
                stream=self.comm_stream)
            self._profile.mark("combine", self.comm_stream)
        event = self._finish(caller, async_finish)
        fw = y_info.framework
        result = CombineResult(arrays.from_cupy(out, fw, name="combined_x"),
                               arrays.from_cupy(out_w, fw) if out_w is not None else None, event)
        self._profile.mark("returned")
        return result

    # ------------------------------------------------------------------------------------------------ misc

    def barrier(self) -> None:
        """A device-side barrier of every rank of the NVLink node, on the communication stream (waits for it)."""
        self._check_open()
        from .kernels import BarrierSpec

        module = jit.load(BarrierSpec(self.group.num_nvl_ranks), self.group.device)
        module.launch("nvl_barrier", 1, 32, self.mem.table_ptr, stream=self.comm_stream)
        self._sync()

    def synchronize(self) -> None:
        """Wait for all of this Buffer's work; raises EpjitTimeoutError if a kernel gave up waiting."""
        self._sync()
        self._check_pending()


__all__ = ["Buffer", "CombineResult", "Config", "DispatchHandle", "DispatchLayout", "DispatchResult", "Event"]
