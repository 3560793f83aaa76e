"""DeepEP's V1 ``Buffer`` (``deep_ep.Buffer``) on epjit's kernels: DeepEP's signatures and tuple returns, each
call mapped onto an :class:`epjit.Buffer` call (docs/deep_ep.md has the table and every difference).

One DeepEP Buffer holds up to two epjit Buffers: a normal-mode one made at construction (``num_nvl_bytes``), and a
low-latency one made at the first low-latency call. DeepEP's low-latency Buffer is made without the sizes epjit's
needs (tokens, hidden size, experts): they come with the first ``low_latency_dispatch`` (or
``clean_low_latency_buffer``), a collective call every rank makes alike, so the epjit Buffer is made there, over
``num_rdma_bytes``, and keeps those sizes. Across NVLink nodes a DeepEP Buffer of both modes is one epjit Buffer:
the normal-mode one, given low-latency mode there, in its heap after normal mode's region.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..config import MAX_CHANNELS
from ..config import Config as EpjitConfig
from ..config import get_combine_config as epjit_combine_config
from ..config import get_dispatch_config as epjit_dispatch_config
from ..errors import ArgumentError, ArgumentTypeError, EpjitError, check_flag, check_int, with_rank
from ..ops.layout import DispatchLayout
from ..ops.streams import Event
from .config import Config, epjit_config, fit_internode
from .handles import NormalHandle
from .scales import (
    check_ue8m0_hidden,
    deepgemm_scales,
    empty_deepgemm_scales,
    fill_deepgemm_scales,
    is_column_major_scales,
)
from .utils import EventHandle, EventOverlap, event_on, overlap_of, previous_event_of
from .views import tensor_over

DEFAULT_NUM_SMS = 24  # epjit's measured default channel count (DeepEP's is 20: docs/deep_ep.md)
LAYOUTS_KEPT = 4  # layouts get_dispatch_layout made that dispatch can still recognise (usually the last one)


# The NVLink node size the epjit group is made with from DeepEP's group (install(num_nvl_ranks=...)); None:
# epjit.init's default, the ranks of a host.
_num_nvl_ranks: int | None = None


def set_num_nvl_ranks(num_nvl_ranks: int | None) -> None:
    """The ``num_nvl_ranks`` every later Buffer passes to ``epjit.init`` (None: the ranks of a host)."""
    global _num_nvl_ranks
    _num_nvl_ranks = None if num_nvl_ranks is None else check_int(num_nvl_ranks, "num_nvl_ranks", 1)


def _make_group(group: Any, comm: Any) -> Any:
    """The epjit Group over DeepEP's ``group`` (a torch ProcessGroup) or ``comm`` (an mpi4py communicator)."""
    from ..group import Group, init

    if isinstance(group, Group):
        return group
    if group is not None:
        return init(torch_group=group, num_nvl_ranks=_num_nvl_ranks)
    if comm is not None:
        return init(comm=comm, num_nvl_ranks=_num_nvl_ranks)
    raise ArgumentError(with_rank("Buffer needs group (a torch ProcessGroup) or comm (an mpi4py communicator), "
                                  "got neither"))


def _new_epjit_buffer(group: Any, **kwargs: Any) -> Any:
    """An epjit Buffer (a seam: the CPU tests put a recording stand-in here)."""
    from ..buffer import Buffer as EpjitBuffer

    return EpjitBuffer(group, **kwargs)


def _unsupported(what: str, why: str) -> NotImplementedError:
    return NotImplementedError(with_rank(f"{what} is not available in epjit's DeepEP API: {why}"))


def _capturing() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _hidden_of(x: Any) -> int:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 2:
        raise ArgumentTypeError(with_rank(f"x must be a [num_tokens, hidden] tensor, got {type(x).__name__} of shape "
                                          f"{shape}"))
    return shape[1]


def _async_or_hook(async_finish: Any, return_recv_hook: Any, call: str) -> bool:
    """Both flags checked; DeepEP refuses both at once (a hook's receive half runs on the stream it is called on,
    so no event from the send half could stand for its results). Returns async_finish."""
    async_finish = check_flag(async_finish, "async_finish")
    if async_finish and check_flag(return_recv_hook, "return_recv_hook"):
        raise ArgumentError(with_rank(f"{call}: async_finish=True and return_recv_hook=True cannot be combined (as in "
                                      "DeepEP): call the hook, then use the results on that stream"))
    return async_finish


def _row_major_scales(x: tuple[Any, ...], previous: Event | None) -> tuple[tuple[Any, ...], Event | None]:
    """An FP8 dispatch's ``(tokens, scales)`` with column-major scales (DeepEP reads them through their strides)
    as epjit's kernels take it: a row-major copy of the scales, made on torch's current stream, which the call is
    ordered after. With a previous_event the copy waits for it (the current stream does), and the call is ordered
    after the copy instead. Any other x is returned as it is (epjit checks it)."""
    if not is_column_major_scales(x):
        return x, previous
    if previous is not None:
        EventHandle.of(previous).current_stream_wait()  # the scales may be written by the work before the event
    copied = (x[0], x[1].contiguous())
    return copied, (EventHandle().event if previous is not None else None)


class LowLatencyHandle:
    """``low_latency_dispatch``'s handle: DeepEP's five items ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)`` with DeepEP's meanings (``layout_range`` is
    ``begin << 32 | count`` in both), as a sequence whose tensors are made when first read; ``.handle`` is epjit's
    :class:`~epjit.buffer.LowLatencyHandle`."""

    __slots__ = ("handle",)

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def _items(self) -> tuple[Any, Any, int, int, int]:
        h = self.handle
        return h.src_info, h.layout_range, h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: Any) -> Any:
        return self._items()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items())


def _epjit_handle(handle: Any, kind: type, call: str) -> Any:
    if type(handle) is not kind:
        raise ArgumentError(with_rank(f"{call}: handle must be the handle a "
                                      f"{'low_latency_dispatch' if kind is LowLatencyHandle else 'dispatch'} of this "
                                      f"Buffer returned, got {type(handle).__name__}"))
    return handle.handle


def _default_epjit_config(kind: str, num_ranks: int) -> EpjitConfig:
    """epjit's default config for the rank count, or its plain defaults where epjit's intranode kernels cannot run
    that many ranks (more than 8: DeepEP's static config calls do not know the node size; the plain defaults satisfy
    the internode kernels' rules up to 8 nodes)."""
    try:
        return (epjit_dispatch_config if kind == "dispatch" else epjit_combine_config)(num_ranks)
    except ArgumentError:
        return EpjitConfig()


class Buffer:
    """DeepEP's V1 Buffer over epjit (docs/deep_ep.md). A collective object: every rank makes it alike."""

    num_sms: int = DEFAULT_NUM_SMS

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None) -> None:
        # num_qps_per_rank, allow_nvlink_for_low_latency_mode and allow_mnnvl tune DeepEP's IBGDA and NVSHMEM
        # transports; epjit picks NVLink stores or NVSHMEM puts itself, so they are accepted and unused.
        if check_flag(use_fabric, "use_fabric"):
            # DeepEP's use_fabric shares its NVLink buffer through CUDA fabric handles (multi-node NVLink) instead
            # of CUDA IPC handles; epjit's NVLink buffer is shared through CUDA IPC handles only.
            raise _unsupported("use_fabric=True", "epjit shares its NVLink buffer through CUDA IPC handles, not "
                                                  "fabric handles")
        self.num_nvl_bytes = check_int(num_nvl_bytes, "num_nvl_bytes")
        self.num_rdma_bytes = check_int(num_rdma_bytes, "num_rdma_bytes")
        self.low_latency_mode = check_flag(low_latency_mode, "low_latency_mode")
        self.explicitly_destroy = check_flag(explicitly_destroy, "explicitly_destroy")
        self.enable_shrink = check_flag(enable_shrink, "enable_shrink")
        self._mask_updates: dict[int, bool] = {}  # shrink mode: updates made before the low-latency Buffer is
        self._group = _make_group(group, comm)
        self.group = group if group is not None else comm  # what DeepEP keeps (callers compare it)
        self.rank, self.group_size = self._group.rank, self._group.size
        self._ll: Any = None
        self._ll_sizes: tuple[int, int, int] | None = None
        self._layouts: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._configs: dict[tuple[str, int], EpjitConfig] = {}
        self._torch_streams: dict[int, Any] = {}
        self._combine_buffers: collections.deque[Any] = collections.deque(maxlen=2)  # the last ones handed out
        self._destroyed = False
        self._normal: Any = None
        several = self._group.num_nvl_ranks < self._group.size
        # Across NVLink nodes a Buffer of both modes is one epjit Buffer: DeepEP's modes share num_rdma_bytes (its
        # callers clean between them), epjit's lie one after the other in the heap, so it gets twice the bytes,
        # normal mode's region first and low-latency mode's added at its first call (docs/deep_ep.md).
        self._one_buffer = several and self.low_latency_mode and bool(self.num_nvl_bytes)
        if self.num_nvl_bytes or not self.low_latency_mode:
            # Across NVLink nodes epjit's normal mode needs the symmetric heap as well (DeepEP's num_rdma_bytes
            # hint covers epjit's: docs/deep_ep.md); inside one node the low-latency Buffer, made at its first
            # call, has the heap and this one none.
            rdma = (2 if self._one_buffer else 1) * self.num_rdma_bytes if several else 0
            self._normal = _new_epjit_buffer(self._group, num_nvl_bytes=self.num_nvl_bytes, num_rdma_bytes=rdma)

    # ------------------------------------------------------------------------------------------------ lifecycle

    def destroy(self) -> None:
        """Collective: release the epjit Buffers (every rank calls it). epjit releases nothing in a destructor, so
        a Buffer made without explicitly_destroy is also released here, or at the end of the process."""
        if self._destroyed:
            return
        self._destroyed = True
        ll, normal, self._ll, self._normal = self._ll, self._normal, None, None
        self._combine_buffers.clear()
        try:
            if ll is not None and ll is not normal:
                ll.close()
        finally:
            if normal is not None:
                normal.close()

    def _check_alive(self) -> None:
        if self._destroyed:
            raise EpjitError(with_rank("this deep_ep Buffer was destroyed"))

    def _normal_buffer(self) -> Any:
        self._check_alive()
        if self._normal is None:
            raise ArgumentError(with_rank("this Buffer has no NVLink buffer for normal mode (low_latency_mode=True "
                                          "with num_nvl_bytes=0): give num_nvl_bytes to use dispatch and combine"))
        return self._normal

    # ------------------------------------------------------------------------------------------------ statics

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: epjit compiles its kernels at run time for the GPU it runs on."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SMs (epjit's channels, one SM each) of the configs get_dispatch_config/get_combine_config give, and
        of calls made without a config."""
        new_num_sms = check_int(new_num_sms, "new_num_sms", 1)
        if new_num_sms > MAX_CHANNELS:
            raise ArgumentError(with_rank(f"new_num_sms={new_num_sms} must be at most {MAX_CHANNELS}"))
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap recorded on torch's current stream now."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """epjit's default dispatch config for the rank count, with ``Buffer.num_sms`` SMs."""
        base = _default_epjit_config("dispatch", check_int(num_ranks, "num_ranks", 1))
        return Config.of(dataclasses.replace(base, num_sms=Buffer.num_sms))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """epjit's default combine config for the rank count, with ``Buffer.num_sms`` SMs."""
        base = _default_epjit_config("combine", check_int(num_ranks, "num_ranks", 1))
        return Config.of(dataclasses.replace(base, num_sms=Buffer.num_sms))

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """num_rdma_bytes for low-latency mode with these sizes: epjit's two buffer sets."""
        from ..buffer import Buffer as EpjitBuffer

        return EpjitBuffer.get_low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                     num_experts)

    def get_comm_stream(self) -> Any:
        """The communication stream as a torch stream: the normal-mode Buffer's, else the low-latency one's."""
        self._check_alive()
        inner = self._normal if self._normal is not None else self._ll
        if inner is None:
            raise ArgumentError(with_rank("this low-latency Buffer has no communication stream yet: it is made at the "
                                          "first low_latency_dispatch or clean_low_latency_buffer"))
        return self._torch_stream(inner)

    def _torch_stream(self, inner: Any) -> Any:
        found = self._torch_streams.get(id(inner))
        if found is None:
            torch = sys.modules["torch"]
            found = torch.cuda.ExternalStream(inner.comm_stream.ptr, device=torch.device("cuda", inner.group.device))
            self._torch_streams[id(inner)] = found
        return found

    def get_local_buffer_tensor(self, dtype: Any, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Any:
        """This rank's NVLink buffer, or with use_rdma_buffer its RDMA buffer, from byte ``offset`` on, as a 1-D
        torch tensor of ``dtype`` (with ``size``: its first prod(size) elements in that shape), over the memory
        itself. epjit's kernels use it during their calls and keep state in it between them (docs/deep_ep.md)."""
        self._check_alive()
        rdma = check_flag(use_rdma_buffer, "use_rdma_buffer")
        offset = check_int(offset, "offset", 0)
        if rdma:
            inner = self._normal if self._group.num_nvl_ranks < self._group.size else self._ll
            if inner is None:
                raise ArgumentError(with_rank(
                    "use_rdma_buffer=True: inside one NVLink node this Buffer's RDMA buffer is its low-latency "
                    "mode's, made at the first low_latency_dispatch (or clean_low_latency_buffer(M, H, E)): make "
                    "that call first"))
            address, num_bytes = inner.local_memory(symmetric=True)
            num_bytes = min(num_bytes, self.num_rdma_bytes)  # (both modes across nodes: normal mode's region)
        else:
            inner = self._normal_buffer()
            address, num_bytes = inner.local_memory()
        if offset > num_bytes:
            raise ArgumentError(with_rank(f"offset={offset} is past the {num_bytes} bytes of the "
                                          f"{'RDMA' if rdma else 'NVLink'} buffer"))
        return tensor_over(address + offset, num_bytes - offset, dtype, size, self._group.device, inner)

    def _config(self, config: Any, kind: str) -> EpjitConfig | None:
        """The epjit config of a call: the given one, or the default for Buffer.num_sms (None: epjit's own)."""
        if config is not None:
            found = epjit_config(config)
            g = self._group
            if found is not None and g.num_nvl_ranks < g.size and not isinstance(config, EpjitConfig):
                found = fit_internode(found, g.size, g.num_nvl_ranks)
            return found
        num_sms = Buffer.num_sms
        if num_sms == DEFAULT_NUM_SMS:
            return None
        found = self._configs.get((kind, num_sms))
        if found is None:
            made = Buffer.get_dispatch_config if kind == "dispatch" else Buffer.get_combine_config
            found = self._configs[(kind, num_sms)] = made(self.group_size).epjit
        return found

    # ------------------------------------------------------------------------------------------------ normal mode

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> tuple[Any, Any, Any, Any, EventOverlap]:
        """(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event)."""
        normal = self._normal_buffer()
        layout = normal.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event_of(previous_event),
                                            async_finish=async_finish)
        in_rank = layout.is_token_in_rank
        self._layouts[id(in_rank)] = layout  # so dispatch given these arrays reads them through their addresses
        while len(self._layouts) > LAYOUTS_KEPT:
            self._layouts.popitem(last=False)
        return (layout.num_tokens_per_rank, layout.num_tokens_per_rdma_rank, layout.num_tokens_per_expert, in_rank,
                overlap_of(layout.event, async_finish))

    def _layout_of(self, per_rank: Any, per_rdma: Any, per_expert: Any, in_rank: Any) -> Any:
        """The epjit layout of a dispatch's four arrays: the one get_dispatch_layout made, if they are its own."""
        if per_rank is None or in_rank is None or per_expert is None:
            raise ArgumentError(with_rank("dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and "
                                          "num_tokens_per_expert (from get_dispatch_layout)"))
        made = self._layouts.get(id(in_rank))
        if (made is not None and made.is_token_in_rank is in_rank and made.num_tokens_per_rank is per_rank
                and made.num_tokens_per_expert is per_expert):
            return made
        return DispatchLayout(per_rank, per_rdma, per_expert, in_rank)  # checked by epjit's dispatch

    def dispatch(self, x: Any, handle: Any = None, num_tokens_per_rank: Any = None,
                 num_tokens_per_rdma_rank: Any = None, is_token_in_rank: Any = None,
                 num_tokens_per_expert: Any = None, topk_idx: Any = None, topk_weights: Any = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Any = None,
                 previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple[Any, Any, Any, Any, Any, EventOverlap]:
        """(recv_x or (recv_x, recv_x_scales), recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event). With ``handle`` the earlier dispatch's routing is replayed: (recv_x, None, None, None, None,
        event)."""
        normal = self._normal_buffer()
        previous = previous_event_of(previous_event)
        if type(x) is tuple:
            x, previous = _row_major_scales(x, previous)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ArgumentError(with_rank("dispatch with a handle replays its routing: topk_idx and topk_weights "
                                              "must be None (as in DeepEP)"))
            d = normal.dispatch(x, handle=_epjit_handle(handle, NormalHandle, "dispatch"),
                                config=self._config(config, "dispatch"), previous_event=previous,
                                async_finish=async_finish)
            recv = (d.x, d.x_scales) if d.x_scales is not None else d.x
            return recv, None, None, None, None, overlap_of(d.event, async_finish)
        layout = self._layout_of(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                                 is_token_in_rank)
        d = normal.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, layout=layout,
                            num_worst_tokens=num_worst_tokens, expert_alignment=expert_alignment,
                            config=self._config(config, "dispatch"), previous_event=previous,
                            async_finish=async_finish)
        recv = (d.x, d.x_scales) if d.x_scales is not None else d.x
        return (recv, d.topk_idx, d.topk_weights, d.num_recv_tokens_per_expert, NormalHandle(d.handle),
                overlap_of(d.event, async_finish))

    def combine(self, x: Any, handle: Any, topk_weights: Any = None, bias: Any = None, config: Any = None,
                previous_event: Any = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, *, use_fp8: bool = False) -> tuple[Any, Any, EventOverlap]:
        """(combined_x, combined_topk_weights, event): for each original token the sum of the rows the ranks send
        back for it, plus bias (one tensor or a pair). ``use_fp8=True``, an epjit extension DeepEP does not have:
        the rows travel as FP8 (epjit.Buffer.combine's use_fp8; across NVLink nodes, each node's partial)."""
        normal = self._normal_buffer()
        c = normal.combine(x, _epjit_handle(handle, NormalHandle, "combine"), topk_weights=topk_weights, bias=bias,
                           config=self._config(config, "combine"), previous_event=previous_event_of(previous_event),
                           async_finish=async_finish, use_fp8=use_fp8)
        return c.x, c.topk_weights, overlap_of(c.event, async_finish)

    # DeepEP's dispatch() and combine() call these across NVLink nodes; epjit's Buffer picks its kernel family from
    # its group itself, so they are the same calls (same signatures and tuples as DeepEP's).
    internode_dispatch = dispatch
    internode_combine = combine

    # ------------------------------------------------------------------------------------------------ low latency

    def _low_latency(self, num_max_dispatch_tokens_per_rank: Any, hidden: Any, num_experts: Any) -> Any:
        """The epjit low-latency Buffer, made at the first call (collective: every rank makes the same call)."""
        sizes = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if self._ll is not None and self._ll_sizes == sizes:
            return self._ll
        self._check_alive()
        if not self.low_latency_mode:
            raise ArgumentError(with_rank("this Buffer was made with low_latency_mode=False"))
        if self._ll is not None:
            raise ArgumentError(with_rank(
                f"this Buffer's low-latency mode was set up at its first call for (num_max_dispatch_tokens_per_rank, "
                f"hidden, num_experts) = {self._ll_sizes}; this call has {sizes}: epjit's low-latency buffers have "
                f"fixed sizes, make another Buffer for these"))
        sizes = (check_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", 1),
                 check_int(hidden, "hidden", 1), check_int(num_experts, "num_experts", 1))
        if _capturing():
            raise EpjitError(with_rank(
                "the first low-latency call of a deep_ep Buffer makes its epjit low-latency Buffer (memory, kernels, "
                "a collective set-up), which cannot happen inside a CUDA-graph capture: run one low_latency_dispatch, "
                "or clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts), before "
                "capturing"))
        if self._one_buffer:
            self._ll = self._low_latency_in_the_normal_buffer(sizes)
        else:
            self._ll = _new_epjit_buffer(self._group, num_rdma_bytes=self.num_rdma_bytes, low_latency_mode=True,
                                         num_max_dispatch_tokens_per_rank=sizes[0], hidden=sizes[1],
                                         num_experts=sizes[2], **({"enable_shrink": True} if self.enable_shrink
                                                                  else {}))
        self._ll_sizes = sizes
        for rank, mask in self._mask_updates.items():
            self._ll.low_latency_update_mask_buffer(rank, mask)
        self._mask_updates.clear()
        return self._ll

    def _low_latency_in_the_normal_buffer(self, sizes: tuple[int, int, int]) -> Any:
        """The normal-mode epjit Buffer, given low-latency mode for these sizes after its normal-mode region
        (collective). num_rdma_bytes must hold the low-latency need, as a Buffer of low-latency mode only."""
        need = Buffer.get_low_latency_rdma_size_hint(sizes[0], sizes[1], self.group_size, sizes[2])
        if self.num_rdma_bytes < need:
            raise ArgumentError(with_rank(
                f"num_rdma_bytes={self.num_rdma_bytes} is below the {need} bytes low-latency mode needs for "
                f"(num_max_dispatch_tokens_per_rank, hidden, num_experts) = {sizes} on {self.group_size} ranks: "
                "use Buffer.get_low_latency_rdma_size_hint(...)"))
        self._normal._add_low_latency(*sizes, enable_shrink=self.enable_shrink)
        return self._normal

    def _made_low_latency(self) -> Any:
        if self._ll is None:
            self._check_alive()
            raise ArgumentError(with_rank("no low_latency_dispatch has run on this Buffer yet"))
        return self._ll

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: forget every earlier low-latency call. On a Buffer whose low-latency mode is not set up yet
        this sets it up, for these sizes (a fresh one has nothing to clean)."""
        if self._ll is None:
            self._low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)
            return
        self._ll.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Any = None,
                             dispatch_wait_recv_cost_stats: Any = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> tuple[Any, Any, LowLatencyHandle, EventOverlap, Any]:
        """(recv_x or (recv_x, recv_x_scales), recv_count, handle, event, hook). The FP8 scales are in DeepEP's
        layout (DeepGEMM's: column-major, UE8M0 packed four to an int32; epjit.deep_ep.scales)."""
        async_finish = _async_or_hook(async_finish, return_recv_hook, "low_latency_dispatch")
        hidden = _hidden_of(x)
        if use_ue8m0 is not False and check_flag(use_ue8m0, "use_ue8m0"):  # before any kernel runs
            check_ue8m0_hidden(hidden)
        ll = self._low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        r = ll.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=use_fp8,
                                    round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=return_recv_hook,
                                    async_finish=async_finish,
                                    cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                                    dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats)
        handle = LowLatencyHandle(r.handle)
        if r.x_scales is None:
            return r.x, r.recv_count, handle, overlap_of(r.event, async_finish), r.hook
        scales, event, hook = self._deepgemm_scales(ll, r, bool(use_ue8m0), async_finish)
        return (r.x, scales), r.recv_count, handle, event, hook

    def _deepgemm_scales(self, ll: Any, r: Any, use_ue8m0: bool,
                         async_finish: bool) -> tuple[Any, EventOverlap, Callable[[], None] | None]:
        """The dispatch's scales in DeepEP's layout, converted where they are valid: on the caller's stream now (it
        waits for the kernels), after the receive half in the hook, or on the communication stream before the
        returned event (async_finish)."""
        src = r.x_scales
        if r.hook is not None:
            out, receive = empty_deepgemm_scales(src, use_ue8m0), r.hook

            def hook() -> None:
                receive()
                fill_deepgemm_scales(out, src, use_ue8m0)

            return out, EventOverlap(None), hook
        if not async_finish:
            return deepgemm_scales(src, use_ue8m0), EventOverlap(None), None
        out = empty_deepgemm_scales(src, use_ue8m0)  # on the caller's stream, which the kernels were ordered after
        stream = self._torch_stream(ll)
        with sys.modules["torch"].cuda.stream(stream):
            fill_deepgemm_scales(out, src, use_ue8m0)
        out.record_stream(stream)
        return out, overlap_of(event_on(ll.comm_stream), True), None

    def low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out: Any = None,
                            combine_wait_recv_cost_stats: Any = None) -> tuple[Any, EventOverlap, Any]:
        """(combined_x, event, hook): for each token, sum over k of topk_weights * the expert output of its row."""
        async_finish = _async_or_hook(async_finish, return_recv_hook, "low_latency_combine")
        ll = self._ll if self._ll is not None else self._made_low_latency()
        inner = _epjit_handle(handle, LowLatencyHandle, "low_latency_combine")
        if zero_copy is not False and check_flag(zero_copy, "zero_copy") and not check_flag(use_logfmt, "use_logfmt"):
            x = self._zero_copy_input(ll, x, inner)  # (with use_logfmt, epjit refuses the pair, as DeepEP asserts)
        c = ll.low_latency_combine(x, topk_idx, topk_weights, inner, zero_copy=zero_copy, out=out,
                                   return_recv_hook=return_recv_hook, async_finish=async_finish,
                                   use_logfmt=use_logfmt, combine_wait_recv_cost_stats=combine_wait_recv_cost_stats)
        return c.x, overlap_of(c.event, async_finish), c.hook

    def _zero_copy_input(self, ll: Any, x: Any, handle: Any) -> Any:
        """With zero_copy=True DeepEP's combine sends what the caller wrote into the buffer
        get_next_low_latency_combine_buffer returned, and reads nothing of x but its shape and dtype: so epjit's
        combine is given that buffer (the same memory, whichever tensor over it the caller passes)."""
        if any(x is given for given in self._combine_buffers):
            return x
        buffer = ll.get_next_low_latency_combine_buffer(handle)
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is None or tuple(shape) != tuple(buffer.shape) or dtype != buffer.dtype:
            raise ArgumentError(with_rank(
                f"low_latency_combine with zero_copy=True sends the buffer get_next_low_latency_combine_buffer "
                f"returned; x must have its shape {tuple(buffer.shape)} and dtype {buffer.dtype}, got "
                f"{type(x).__name__} of shape {None if shape is None else tuple(shape)} and dtype {dtype}"))
        return buffer

    def get_next_low_latency_combine_buffer(self, handle: Any) -> Any:
        """A [L, R*M, H] bf16 tensor to write the next low_latency_combine's expert outputs into, for
        zero_copy=True (that combine then sends this buffer's contents, whatever x it is given)."""
        ll = self._ll if self._ll is not None else self._made_low_latency()
        buffer = ll.get_next_low_latency_combine_buffer(
            _epjit_handle(handle, LowLatencyHandle, "get_next_low_latency_combine_buffer"))
        self._combine_buffers.append(buffer)
        return buffer

    def _shrink(self, call: str) -> Any:
        """The low-latency Buffer of a shrink-mode Buffer, or None before its first low-latency call."""
        self._check_alive()
        if not self.enable_shrink:
            raise ArgumentError(with_rank(f"{call} needs a Buffer made with enable_shrink=True"))
        return self._ll

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (mask=True) or unmask rank_to_mask in this rank's low-latency calls (shrink mode)."""
        ll = self._shrink("low_latency_update_mask_buffer")
        if ll is not None:
            ll.low_latency_update_mask_buffer(rank_to_mask, mask)
            return
        rank = check_int(rank_to_mask, "rank_to_mask")  # kept until the low-latency Buffer is made
        if rank >= self.group_size:
            raise ArgumentError(with_rank(f"rank_to_mask={rank} is not a rank of this Buffer's {self.group_size}"))
        self._mask_updates[rank] = check_flag(mask, "mask")

    def low_latency_query_mask_buffer(self, mask_status: Any) -> None:
        """Write the mask ([num_ranks] torch.int, 1 = masked) into mask_status (shrink mode)."""
        ll = self._shrink("low_latency_query_mask_buffer")
        if ll is None:
            raise ArgumentError(with_rank("low_latency_query_mask_buffer: no low_latency_dispatch has run on this "
                                          "Buffer yet"))
        ll.low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (shrink mode)."""
        ll = self._shrink("low_latency_clean_mask_buffer")
        if ll is not None:
            ll.low_latency_clean_mask_buffer()
        self._mask_updates.clear()

