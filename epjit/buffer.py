"""Buffer: the user API of epjit: argument validation, and delegation to the kernel families (epjit.ops).

A Buffer owns the peer memory (CUDA IPC NVLink buffers; the symmetric region of num_rdma_bytes, on CUDA IPC memory
inside one NVLink node and on NVSHMEM's heap across nodes), a communication stream and the kernels. Every call
validates its arguments before any kernel runs; arguments that must agree across ranks (hidden, num_experts, top-k,
FP8 or not) are compared inside the notify step, so a mismatch raises on every rank instead of hanging one.
Streams and events: epjit.ops.streams.

Validation is done once per shape: each call's arrays are reduced to a fingerprint (framework, dtype, shape,
contiguity, device: epjit.arrays.fingerprint), and a call whose fingerprints and arguments were validated before
reuses that call's plan (its checked sizes, output shapes and the kernels' constant arguments). So a bad input
raises the same error on every call, and a good one costs the host well under a microsecond to re-check.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from . import arrays
from .arrays import address, fingerprint
from .config import (
    MAX_CHANNELS,
    Config,
    check_internode_need,
    check_normal_sizes,
    config_key,
    expert_cap,
    get_combine_config,
    get_dispatch_config,
    normal_size_hint,
    rdma_size_hint,
)
from .env import settings
from .errors import ArgumentError, ArgumentTypeError, EpjitError, SetupError, check_flag, check_int, with_rank
from .group import Group
from .kernels import BarrierSpec
from .kernels.intranode import intranode_min_nvl_bytes
from .kernels.low_latency import (
    LOW_LATENCY_MAX_TOPK,
    MAX_DYNAMIC_SHARED_BYTES,
    dispatch_shared_bytes,
    low_latency_size_hint,
)
from .memory import PeerMemory, symmetric_memory
from .ops.internode import Internode
from .ops.intranode import CombineResult, DispatchHandle, DispatchInputs, DispatchResult, Intranode, LayoutInputs
from .ops.layout import DispatchLayout, Layout
from .ops.loader import load
from .ops.low_latency import LowLatency, LowLatencyCombineResult, LowLatencyDispatchResult, LowLatencyHandle
from .ops.profile import Profile
from .ops.streams import Event, Outputs, Streams, caller_stream, is_capturing

_MAX_PLANS = 512  # plans kept per Buffer (a model has a few shapes; a sweep over many starts again)


def _group_of(group: Any) -> Group:
    """The epjit group over a torch ProcessGroup (DeepEP's Buffer takes one), made or found by ``epjit.init``."""
    from .group import init
    from .group.torch_dist import is_process_group

    if is_process_group(group):
        return init(torch_group=group)
    raise ArgumentTypeError(with_rank(f"group must be what epjit.init() returns or a torch ProcessGroup, got "
                                      f"{type(group).__name__}"))


class Buffer:
    """Peer memory, streams and kernels for expert-parallel dispatch/combine (a collective object: every rank of
    the group constructs and closes it together)."""

    def __init__(self, group: Group | Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_max_dispatch_tokens_per_rank: int = 0, hidden: int = 0,
                 num_experts: int = 0) -> None:
        if not isinstance(group, Group):
            group = _group_of(group)
        # As ints, before any collective or GPU work: "1GB", 1.5 or True is no size (int() would make one of them).
        num_nvl_bytes, num_rdma_bytes, self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts = (
            check_int(value, f"Buffer({name}=...)") for name, value in (
                ("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes),
                ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
                ("num_experts", num_experts)))
        self.low_latency_mode = check_flag(low_latency_mode, "Buffer(low_latency_mode=...)")
        group.check_same("Buffer(num_nvl_bytes, num_rdma_bytes, low_latency_mode)",
                         (num_nvl_bytes, num_rdma_bytes, self.low_latency_mode))
        if group.device is None:
            raise SetupError(with_rank("epjit.Buffer needs a GPU, and epjit.init() bound none on this rank"))
        self.group, self.num_ranks, self.rank = group, group.size, group.rank
        if self.low_latency_mode:
            num_rdma_bytes = self._check_low_latency_sizes(num_rdma_bytes)
        if num_nvl_bytes or not self.low_latency_mode:  # normal mode (a low-latency Buffer may have both)
            check_normal_sizes(group.size, group.num_nvl_ranks, num_nvl_bytes, num_rdma_bytes, self.num_experts,
                               self.low_latency_mode)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self._settings = settings()  # read once: the environment is not re-read on the hot path
        self._device = group.device
        where = symmetric_memory(group, self._settings.ll_force_puts, self._settings.one_node_nvshmem,
                                 self._settings.rdma_by_stores)
        self.mem = PeerMemory.create(group, self.num_nvl_bytes, self.num_rdma_bytes, symmetric=where)
        self._normal_ops: Intranode | None = None  # the normal-mode family: Intranode, or Internode across nodes
        self._ll: LowLatency | None = None
        try:
            self._streams = Streams(group.device)
            self._outputs = Outputs(self._streams, group.device, self._settings.poison_outputs)
            self._profile = Profile(self._settings.profile)
            if self.num_nvl_bytes:
                self._layout = Layout(self._streams, self._outputs, group.device, group.size, group.num_nvl_ranks)
                args = (self.mem, self._streams, self._outputs, self._profile, group.device, self.num_experts)
                self._normal_ops = Intranode(*args) if group.num_nvl_ranks == group.size else \
                    Internode(*args, expert_cap(self.num_experts))
                # what a call without a config gets
                self._dispatch_config = get_dispatch_config(self.num_ranks, num_nvl_ranks=group.num_nvl_ranks)
                self._combine_config = get_combine_config(self.num_ranks, num_nvl_ranks=group.num_nvl_ranks)
            if self.low_latency_mode:
                self._ll = LowLatency(self.mem, self._streams, self._outputs, self._profile, group.device,
                                      self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts,
                                      self._settings.ll_force_puts, self._settings.ll_num_sms)
        except BaseException:
            for family in (self._ll, self._normal_ops):
                if family is not None:
                    family.close()
            self.mem.close()
            raise
        self.comm_stream = self._streams.comm
        self._plans: dict[tuple[Any, ...], Any] = {}
        self._closed = False

    def _check_low_latency_sizes(self, num_rdma_bytes: int) -> int:
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
        shared = dispatch_shared_bytes(h, m, LOW_LATENCY_MAX_TOPK, e, r)
        if shared > MAX_DYNAMIC_SHARED_BYTES:
            raise ArgumentError(with_rank(
                f"num_max_dispatch_tokens_per_rank={m} with hidden={h} is too large for low-latency mode: each "
                f"dispatch block stages two tokens, every topk_idx entry and two ints an expert in shared memory "
                f"({shared} bytes at top-{LOW_LATENCY_MAX_TOPK}, {MAX_DYNAMIC_SHARED_BYTES} available)"))
        need = low_latency_size_hint(m, h, r, e)
        if num_rdma_bytes and num_rdma_bytes < need:
            raise ArgumentError(with_rank(
                f"num_rdma_bytes={num_rdma_bytes} is below the {need} bytes low-latency mode needs for "
                f"{m} tokens x hidden {h} x {e} experts on {r} ranks: use Buffer.get_low_latency_size_hint(...)"))
        return num_rdma_bytes or need

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
                if self._ll is not None:
                    self._ll.raise_status()
            except ArgumentError as e:
                refusal = e
        finally:
            for family in (self._normal_ops, self._ll):
                if family is not None:
                    family.close()
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
                             config: Config | None = None, num_nvl_ranks: int | None = None) -> int:
        """num_nvl_bytes for normal-mode dispatch and combine of these sizes with the default (or given) config;
        across NVLink nodes (num_nvl_ranks < num_ranks) what the internode kernels need of it."""
        hint = normal_size_hint(num_ranks, hidden, num_topk, num_experts, config, num_nvl_ranks)  # checks sizes
        if num_nvl_ranks is not None and num_nvl_ranks != num_ranks:
            return hint  # across nodes: the internode kernels' layout, control words included
        return max(hint, intranode_min_nvl_bytes(int(num_ranks), MAX_CHANNELS))

    @staticmethod
    def get_rdma_size_hint(num_ranks: int, hidden: int, num_topk: int = 8, num_experts: int = 256,
                           config: Config | None = None, num_nvl_ranks: int | None = None) -> int:
        """num_rdma_bytes (symmetric heap) for normal mode across NVLink nodes with these sizes (0 in one node)."""
        return rdma_size_hint(num_ranks, hidden, num_topk, num_experts, config, num_nvl_ranks)

    @staticmethod
    def get_low_latency_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                  num_experts: int) -> int:
        """num_rdma_bytes (symmetric heap per rank) that low-latency mode needs for these sizes: two buffer sets."""
        return low_latency_size_hint(*(check_int(value, name, 1) for name, value in (
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
            ("num_ranks", num_ranks), ("num_experts", num_experts))))

    def profile(self) -> dict[str, float]:
        """Where the last call spent its time (needs EPJIT_PROFILE=1; waits for that call's work): host
        microseconds to each mark of a normal-mode call, and for each kernel launched with a timeline when its
        blocks reached each point (``<kernel>:<point>:med`` / ``:max``, microseconds from the first block's start)."""
        return self._profile.report()

    def profile_blocks(self) -> dict[str, list[tuple[int, ...]]]:
        """The last call's stamps block by block (needs EPJIT_PROFILE=1): per kernel, one row a block with its SM
        id and its channel (-1: none), then its points in microseconds from the first block's start."""
        return self._profile.blocks()

    def barrier(self) -> None:
        """A device-side barrier of every rank of the NVLink node, on the communication stream (waits for it)."""
        self._check_open()
        module = load(BarrierSpec(self.group.num_nvl_ranks), self._device)
        module.launch(module.spec.args("nvl_barrier", peers=self.mem.table_ptr), 1, 32, stream=self.comm_stream)
        self.mem.synchronize(self.comm_stream)

    def synchronize(self) -> None:
        """Wait for all of this Buffer's work; raises EpjitTimeoutError if a kernel gave up waiting, and what a
        refused or wrong earlier call found that no call has raised yet."""
        self.mem.synchronize(self.comm_stream)
        self._check_pending()
        if self._ll is not None:
            self._ll.raise_status()

    # ------------------------------------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise EpjitError(with_rank("this Buffer is closed"))

    def _normal(self) -> Intranode:
        self._check_open()
        if self._normal_ops is None:
            raise EpjitError(with_rank("this Buffer has no NVLink buffer (num_nvl_bytes=0): normal-mode calls need "
                                       "one (Buffer.get_normal_size_hint)"))
        return self._normal_ops

    def _low_latency(self) -> LowLatency:
        self._check_open()
        if self._ll is None:
            raise EpjitError(with_rank("this Buffer was not made with low_latency_mode=True"))
        self._ll.raise_status()
        return self._ll

    def _check_pending(self) -> None:
        if self._normal_ops is not None:
            self._normal_ops.check_pending(self._caller_capturing)

    def _caller_capturing(self) -> bool:
        """Whether a caller's stream (torch's current one, if torch is in use, or CuPy's) is capturing a graph."""
        streams = {caller_stream("cupy", self._device)}
        if "torch" in sys.modules:
            streams.add(caller_stream("torch", self._device))
        return any(is_capturing(s) for s in streams)

    def _remember(self, key: tuple[Any, ...], plan: Any) -> Any:
        """Keep ``plan`` for the next call with this key, unless some array of the key had no fingerprint (None:
        a JAX array, say, whose every call is checked in full). Keys hold no other None."""
        if None not in key:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _check_num_experts(self, num_experts: Any) -> int:
        num_experts = check_int(num_experts, "num_experts", 1)
        if num_experts % self.num_ranks:
            raise ArgumentError(with_rank(f"num_experts={num_experts} is not divisible by the {self.num_ranks} "
                                          "ranks (each rank owns num_experts / ranks experts)"))
        return num_experts

    # ------------------------------------------------------------------------------------------------ layout

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Event | None = None,
                            async_finish: bool = False) -> DispatchLayout:
        """Counts per rank and per expert, and is_token_in_rank, for topk_idx [N, K] int64 (-1 = no expert)."""
        if self._closed or self._normal_ops is None:
            self._normal()  # raises what is wrong
        if type(num_experts) is not int:  # no 64.0 or True in a key: it would find the plan of 64 or 1
            num_experts = self._check_num_experts(num_experts)
        key = ("layout", fingerprint(topk_idx), num_experts, previous_event is None)
        plan = self._plans.get(key)
        if plan is None:
            info = arrays.check(topk_idx, "topk_idx", dtype="int64", ndim=2, device=self._device)
            num_experts = self._check_num_experts(num_experts)
            kind = "torch" if info.framework == "torch" and previous_event is None else "cupy"
            plan = self._remember(key, self._layout.plan(info.framework, kind, *info.shape, num_experts))
            idx_arg = arrays.kernel_arg(topk_idx, info, "topk_idx")
        else:
            idx_arg = address(topk_idx)
        return self._layout.run(plan, topk_idx, idx_arg, previous_event, check_flag(async_finish, "async_finish"))

    def _layout_inputs(self, layout: DispatchLayout, num_tokens: int) -> tuple[LayoutInputs, int]:
        """A layout's kernel arguments and its number of experts: taken as made if get_dispatch_layout made it for
        this many tokens, validated otherwise."""
        if not isinstance(layout, DispatchLayout):
            raise ArgumentTypeError(with_rank(f"layout must be a DispatchLayout, got {type(layout).__name__}"))
        made = layout.made
        if made is not None and made.num_tokens == num_tokens:
            return LayoutInputs(made.per_rank_ptr, made.per_expert_ptr, made.in_rank_ptr, made, made.invalid_ptr,
                                (made.owner,), made.per_node_ptr), made.num_experts
        dev = self._device
        r_info = arrays.check(layout.num_tokens_per_rank, "layout.num_tokens_per_rank", dtype="int32",
                              shape=(self.num_ranks,), device=dev)
        e_info = arrays.check(layout.num_tokens_per_expert, "layout.num_tokens_per_expert", dtype="int32", ndim=1,
                              device=dev)
        t_info = arrays.check(layout.is_token_in_rank, "layout.is_token_in_rank", dtype="bool",
                              shape=(("N", num_tokens), self.num_ranks), shape_note="with N matching x", device=dev)
        in_rank = arrays.kernel_arg(layout.is_token_in_rank, t_info, "layout.is_token_in_rank")
        owner = layout.is_token_in_rank if isinstance(in_rank, int) else in_rank  # an address, or a CuPy view
        keep = (layout.num_tokens_per_rank, layout.num_tokens_per_expert, layout.is_token_in_rank)
        per_node: Any = 0
        if self.group.num_nvl_ranks < self.num_ranks:  # the counts a node: notify's RDMA leg sends them
            n_info = arrays.check(layout.num_tokens_per_rdma_rank, "layout.num_tokens_per_rdma_rank", dtype="int32",
                                  shape=(self.num_ranks // self.group.num_nvl_ranks,), device=dev)
            per_node = arrays.kernel_arg(layout.num_tokens_per_rdma_rank, n_info, "layout.num_tokens_per_rdma_rank")
            keep += (layout.num_tokens_per_rdma_rank,)
        return LayoutInputs(arrays.kernel_arg(layout.num_tokens_per_rank, r_info, "layout.num_tokens_per_rank"),
                            arrays.kernel_arg(layout.num_tokens_per_expert, e_info, "layout.num_tokens_per_expert"),
                            in_rank, owner, 0, keep, per_node), self._check_num_experts(e_info.shape[0])

    # ------------------------------------------------------------------------------------------------ dispatch

    def dispatch(self, x: Any, topk_idx: Any = None, topk_weights: Any = None, layout: DispatchLayout | None = None,
                 handle: DispatchHandle | None = None, num_worst_tokens: int = 0, expert_alignment: int = 1,
                 config: Config | None = None, previous_event: Event | None = None,
                 async_finish: bool = False, num_experts: int | None = None) -> DispatchResult:
        """Send every token to each rank owning one of its experts (docs/api.md: normal dispatch semantics).

        x is [N, H] bf16, or a pair (x_fp8 [N, H] float8_e4m3fn, scales [N, H/128] float32). Without a handle,
        ``layout`` (from get_dispatch_layout) is required, or topk_idx plus num_experts (here or on the Buffer).
        With a handle, the routing of that earlier dispatch is replayed with no layout pass.

        The outputs are allocated before the counts are known, so the GPU does not wait for this host: without
        num_worst_tokens or a handle they are the first rows of arrays sized by an estimate; when some rank's rows
        do not fit, every rank runs the call again with exact sizes.
        """
        normal = self._normal()
        normal.check_pending(self._caller_capturing)
        async_finish = check_flag(async_finish, "async_finish")  # before the layout kernel a call may run
        # Numbers enter the plan key as ints: 8.0 or True would find the plan of 8 or 1 and skip every check.
        if type(num_worst_tokens) is not int or type(expert_alignment) is not int:
            num_worst_tokens = check_int(num_worst_tokens, "num_worst_tokens")
            expert_alignment = check_int(expert_alignment, "expert_alignment", 1)
        if num_experts is not None and type(num_experts) is not int:
            num_experts = check_int(num_experts, "num_experts", 1)
        auto_experts = 0  # dispatch computes the layout itself (from topk_idx)
        if handle is not None:
            if not isinstance(handle, DispatchHandle) or handle.buffer_id != id(self):
                raise ArgumentError(with_rank("handle must come from a dispatch of this Buffer"))
            source: Any = (handle.num_tokens, handle.hidden, handle.num_topk, handle.num_channels, handle.num_experts)
        elif layout is not None:
            made = layout.made if isinstance(layout, DispatchLayout) else None
            source = None if made is None else ("layout", made.num_tokens, made.num_experts)
        elif topk_idx is not None:
            auto_experts = num_experts if num_experts is not None else self.num_experts
            if not auto_experts:
                raise ArgumentError(with_rank("dispatch without a layout needs num_experts (here or on the Buffer) "
                                              "to compute one"))
            source = ("auto", auto_experts)
        else:
            raise ArgumentError(with_rank("dispatch needs layout=get_dispatch_layout(...), or topk_idx, or a handle"))
        key = ("dispatch", fingerprint(x), fingerprint(topk_idx), fingerprint(topk_weights), source,
               num_worst_tokens, expert_alignment, config_key(config), previous_event is None)
        plan = self._plans.get(key)
        if plan is None:
            plan, inputs, layout_inputs = self._dispatch_plan(key, x, topk_idx, topk_weights, handle, layout,
                                                              auto_experts, num_worst_tokens, expert_alignment,
                                                              config, previous_event)
        else:
            fp8 = plan.fp8
            inputs = DispatchInputs(x, address(x[0]) if fp8 else address(x), address(x[1]) if fp8 else 0, topk_idx,
                                    address(topk_idx), topk_weights, address(topk_weights))
            if auto_experts:
                layout = self.get_dispatch_layout(topk_idx, auto_experts)
            layout_inputs = None if handle is not None else self._layout_inputs(layout, plan.num_tokens)[0]
        return normal.dispatch(plan, inputs, layout_inputs, handle, id(self), previous_event, async_finish)

    def _dispatch_x(self, x: Any) -> tuple[arrays.ArrayInfo, Any, Any, bool]:
        """x's description and kernel arguments (x, scales), and whether it is FP8."""
        dev = self._device
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ArgumentError(with_rank(f"x must be an array or a pair (x_fp8, scales), got {len(x)} items"))
            x_info = arrays.check(x[0], "x", dtype="float8_e4m3fn", ndim=2, device=dev)
            num_tokens, hidden = x_info.shape
            if hidden % 128:
                raise ArgumentError(with_rank(f"FP8 x has hidden={hidden}, which is not a multiple of 128"))
            s_info = arrays.check(x[1], "x_scales", dtype="float32", shape=(("N", num_tokens), hidden // 128),
                                  shape_note="with N matching x and one scale per 128 channels", device=dev)
            return x_info, arrays.kernel_arg(x[0], x_info, "x"), arrays.kernel_arg(x[1], s_info, "x_scales"), True
        x_info = arrays.check(x, "x", dtype="bfloat16", ndim=2, device=dev)
        return x_info, arrays.kernel_arg(x, x_info, "x"), 0, False

    def _dispatch_topk(self, topk_idx: Any, topk_weights: Any, num_tokens: int) -> tuple[int, Any, Any]:
        """top-k and the kernel arguments of topk_idx and topk_weights (None: not given)."""
        dev = self._device
        idx_arg = w_arg = None
        num_topk = 0
        if topk_idx is not None:
            k_info = arrays.check(topk_idx, "topk_idx", dtype="int64", shape=(("N", num_tokens), "K"),
                                  shape_note="with N matching x", device=dev)
            num_topk = k_info.shape[1]
            if not 1 <= num_topk <= 32:
                raise ArgumentError(with_rank(f"topk_idx has {num_topk} columns; 1 to 32 are supported"))
            idx_arg = arrays.kernel_arg(topk_idx, k_info, "topk_idx")
        if topk_weights is not None:
            if topk_idx is None:
                raise ArgumentError(with_rank("topk_weights given without topk_idx"))
            w_info = arrays.check(topk_weights, "topk_weights", dtype="float32",
                                  shape=(("N", num_tokens), ("K", num_topk)), shape_note="matching topk_idx",
                                  device=dev)
            w_arg = arrays.kernel_arg(topk_weights, w_info, "topk_weights")
        return num_topk, idx_arg, w_arg

    def _resolve_config(self, config: Config | None, base: Config, num_channels: int | None,
                        what: str) -> Config:
        """The config a call runs with: the given one or ``base``, on a replayed handle's channels."""
        if config is not None and not isinstance(config, Config):
            raise ArgumentTypeError(with_rank(f"config must be an epjit.Config, got {type(config).__name__}"))
        if config is not None and num_channels is not None and config.num_channels != num_channels:
            raise ArgumentError(with_rank(f"config.num_sms={config.num_sms} but {what} was made with "
                                          f"{num_channels} SMs"))
        config = config or base
        if num_channels is not None and num_channels != config.num_channels:
            config = dataclasses.replace(config, num_sms=num_channels)
        return config

    def _spec_of(self, config: Config) -> Any:
        if isinstance(self._normal_ops, Internode):
            return config.internode_spec(self.num_ranks, self.group.num_nvl_ranks)
        try:
            return config.spec(self.num_ranks)
        except ValueError as e:
            raise ArgumentError(with_rank(f"config's warp roles cannot run on {self.num_ranks} ranks: {e}")) from None

    def _check_nvl_need(self, config: Config, hidden: int, num_topk: int, num_experts: int, fp8: bool,
                        what: str) -> None:
        # Every rank computes the same need from the same (checked-in-notify) sizes, so all raise together when
        # the sizes agree; when they do not, notify reports the mismatch on every rank.
        if isinstance(self._normal_ops, Internode):
            check_internode_need(config, self.num_ranks, self.group.num_nvl_ranks, hidden, num_topk, num_experts,
                                 self.num_experts, (self.num_nvl_bytes, self.num_rdma_bytes), what)
            return
        need = config.nvl_bytes(self.num_ranks, hidden, num_topk, num_experts, fp8)
        if need > self.num_nvl_bytes:
            raise ArgumentError(with_rank(
                f"this {what} needs {need} bytes of NVLink buffer (hidden={hidden}, top-{num_topk}, {num_experts} "
                f"experts, {config}) but the Buffer has {self.num_nvl_bytes}: use Buffer.get_normal_size_hint(...)"))

    def _dispatch_plan(self, key: tuple[Any, ...], x: Any, topk_idx: Any, topk_weights: Any,
                       handle: DispatchHandle | None, layout: Any, auto_experts: int, num_worst_tokens: Any,
                       expert_alignment: Any, config: Config | None,
                       previous_event: Event | None) -> tuple[Any, DispatchInputs, LayoutInputs | None]:
        """Validate a dispatch whose shape has no plan yet (a layout built by hand has none: it is checked here every
        call); its plan, this call's inputs, and its layout's (None with a handle; computed here, once everything
        else is checked, when the call gave topk_idx and no layout)."""
        x_info, x_arg, scales_arg, fp8 = self._dispatch_x(x)
        num_tokens, hidden = x_info.shape
        if hidden % 8 or hidden <= 0:
            raise ArgumentError(with_rank(f"hidden={hidden} must be a positive multiple of 8 (16-byte rows)"))
        num_topk, idx_arg, w_arg = self._dispatch_topk(topk_idx, topk_weights, num_tokens)
        num_worst_tokens = check_int(num_worst_tokens, "num_worst_tokens")
        expert_alignment = check_int(expert_alignment, "expert_alignment", 1)
        if handle is not None:
            if handle.num_tokens != num_tokens or handle.hidden != hidden:
                raise ArgumentError(with_rank(f"x is [{num_tokens}, {hidden}] but the handle was made for "
                                              f"[{handle.num_tokens}, {handle.hidden}]"))
            if idx_arg is not None and num_topk != handle.num_topk:
                raise ArgumentError(with_rank(f"topk_idx has {num_topk} columns, the handle {handle.num_topk}"))
            num_experts = handle.num_experts
            config = self._resolve_config(config, self._dispatch_config, handle.num_channels, "the handle")
        else:
            config = self._resolve_config(config, self._dispatch_config, None, "")
            if auto_experts:
                self._check_nvl_need(config, hidden, num_topk, self._check_num_experts(auto_experts), fp8, "dispatch")
                layout = self.get_dispatch_layout(topk_idx, auto_experts)
            layout_inputs, num_experts = self._layout_inputs(layout, num_tokens)
        self._check_nvl_need(config, hidden, num_topk, num_experts, fp8, "dispatch")
        kind = "torch" if x_info.framework == "torch" and previous_event is None else "cupy"
        plan = self._normal_plan().dispatch_plan(
            x_info.framework, kind, self._spec_of(config), config, num_tokens, hidden, num_topk, fp8,
            w_arg is not None, idx_arg is not None, num_experts, num_worst_tokens, expert_alignment,
            handle is not None)
        inputs = DispatchInputs(x, x_arg, scales_arg, topk_idx, 0 if idx_arg is None else idx_arg, topk_weights,
                                0 if w_arg is None else w_arg)
        return self._remember(key, plan), inputs, None if handle is not None else layout_inputs

    def _normal_plan(self) -> Intranode:
        assert self._normal_ops is not None
        return self._normal_ops

    # ------------------------------------------------------------------------------------------------ combine

    def combine(self, y: Any, handle: DispatchHandle, topk_weights: Any = None, bias: Any = None,
                config: Config | None = None, previous_event: Event | None = None,
                async_finish: bool = False) -> CombineResult:
        """For each original token, the sum of the rows the ranks send back for it (+ bias): dispatch's adjoint."""
        normal = self._normal_ops if not self._closed else None
        if normal is None:
            normal = self._normal()  # raises what is wrong
        normal.check_pending(self._caller_capturing)
        if not isinstance(handle, DispatchHandle) or handle.buffer_id != id(self):
            raise ArgumentError(with_rank("handle must be the .handle of a dispatch of this Buffer"))
        key = ("combine", fingerprint(y), fingerprint(topk_weights), fingerprint(bias), handle.num_rows,
               handle.num_tokens, handle.hidden, handle.num_topk, handle.num_channels, config_key(config),
               previous_event is None)
        plan = self._plans.get(key)
        biases = tuple(bias) if isinstance(bias, (tuple, list)) else (() if bias is None else (bias,))
        if plan is None:
            plan, y_arg, w_arg, bias_args = self._combine_plan(key, y, handle, topk_weights, biases, config,
                                                               previous_event)
        elif plan.kind == "torch" and not biases:
            y_arg, w_arg, bias_args = y.data_ptr(), address(topk_weights), (0, 0)
        else:
            y_arg, w_arg = address(y), address(topk_weights)
            bias_args = (address(biases[0]) if biases else 0, address(biases[1]) if len(biases) > 1 else 0)
        return normal.combine(plan, handle, y, y_arg, topk_weights, w_arg, biases, bias_args, previous_event,
                              check_flag(async_finish, "async_finish"))

    def _combine_plan(self, key: tuple[Any, ...], y: Any, handle: DispatchHandle, topk_weights: Any,
                      biases: tuple[Any, ...], config: Config | None,
                      previous_event: Event | None) -> tuple[Any, Any, Any, tuple[Any, Any]]:
        dev = self._device
        y_info = arrays.check(y, "y", dtype="bfloat16", shape=(("rows", handle.num_rows), ("H", handle.hidden)),
                              shape_note="as the dispatch delivered", device=dev)
        w_arg = 0
        if topk_weights is not None:
            if handle.num_topk == 0:
                raise ArgumentError(with_rank("topk_weights given but the dispatch had no topk_idx"))
            w_info = arrays.check(topk_weights, "topk_weights", dtype="float32",
                                  shape=(("rows", handle.num_rows), ("K", handle.num_topk)), device=dev)
            w_arg = arrays.kernel_arg(topk_weights, w_info, "topk_weights")
        if not 0 <= len(biases) <= 2:
            raise ArgumentError(with_rank(f"bias must be one array or a pair, got {len(biases)}"))
        bias_args = [0, 0]
        for i, b in enumerate(biases):
            b_info = arrays.check(b, f"bias[{i}]", dtype="bfloat16",
                                  shape=(("N", handle.num_tokens), ("H", handle.hidden)), device=dev)
            bias_args[i] = arrays.kernel_arg(b, b_info, f"bias[{i}]")
        config = self._resolve_config(config, self._combine_config, handle.num_channels, "the dispatch")
        self._check_nvl_need(config, handle.hidden, handle.num_topk, 0, False, "combine")
        kind = "torch" if y_info.framework == "torch" and previous_event is None else "cupy"
        plan = self._normal_plan().combine_plan(y_info.framework, kind, self._spec_of(config), config, handle,
                                                    topk_weights is not None)
        return (self._remember(key, plan), arrays.kernel_arg(y, y_info, "y"), w_arg,
                (bias_args[0], bias_args[1]))

    # ------------------------------------------------------------------------------------------------ low latency

    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             return_recv_hook: bool = False, async_finish: bool = False,
                             cumulative_local_expert_recv_stats: Any = None) -> LowLatencyDispatchResult:
        """Send each (token, chosen expert) straight to a fixed slot of the expert's rank (docs/api.md: low-latency
        dispatch). x is [N, H] bf16 with N <= num_max_dispatch_tokens_per_rank; topk_idx [N, K] int64, -1 = none.

        Returns x [L, R*max, H] (FP8 with x_scales [L, R*max, H/128], or bf16), recv_count [L], and a handle for
        low_latency_combine. With return_recv_hook the send half runs now and ``result.hook()`` runs the receive
        half; the arrays are valid after it.
        """
        ll = self._ll if not self._closed else None
        if ll is None:
            ll = self._low_latency()  # raises what is wrong
        ll.raise_status()
        if type(num_max_dispatch_tokens_per_rank) is not int or type(num_experts) is not int:  # as in dispatch
            num_max_dispatch_tokens_per_rank = check_int(num_max_dispatch_tokens_per_rank,
                                                         "num_max_dispatch_tokens_per_rank", 1)
            num_experts = check_int(num_experts, "num_experts", 1)
        stats = cumulative_local_expert_recv_stats
        key = ("ll_dispatch", fingerprint(x), fingerprint(topk_idx), fingerprint(stats),
               num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0)
        plan = self._plans.get(key)
        if plan is None:
            plan, x_arg, idx_arg, stats_arg = self._low_latency_dispatch_plan(
                key, ll, x, topk_idx, stats, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                use_ue8m0)
        elif plan.torch:
            x_arg, idx_arg = x.data_ptr(), topk_idx.data_ptr()
            stats_arg = stats.data_ptr() if stats is not None else 0
        else:
            x_arg, idx_arg, stats_arg = address(x), address(topk_idx), address(stats)
        return ll.dispatch(plan, id(self), x, x_arg, topk_idx, idx_arg, stats, stats_arg,
                           check_flag(return_recv_hook, "return_recv_hook"), check_flag(async_finish, "async_finish"))

    def _low_latency_dispatch_plan(self, key: tuple[Any, ...], ll: LowLatency, x: Any, topk_idx: Any, stats: Any,
                                   num_max: int, num_experts: int, use_fp8: Any, round_scale: Any,
                                   use_ue8m0: Any) -> tuple[Any, Any, Any, Any]:
        dev = self._device
        # The flags are in the key as given: "False" (truthy) never finds a plan, and is refused here.
        use_fp8, round_scale, use_ue8m0 = (check_flag(v, n) for v, n in (
            (use_fp8, "use_fp8"), (round_scale, "round_scale"), (use_ue8m0, "use_ue8m0")))
        m, hidden, e, r = self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts, self.num_ranks
        if num_max != m or num_experts != e:
            raise ArgumentError(with_rank(f"num_max_dispatch_tokens_per_rank={num_max}, num_experts={num_experts}: "
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
        round_scale = round_scale or use_ue8m0
        if not use_fp8 and round_scale:
            raise ArgumentError(with_rank("round_scale and use_ue8m0 need use_fp8=True"))
        if use_fp8 and hidden % 128:
            raise ArgumentError(with_rank(f"use_fp8=True needs hidden % 128 == 0, hidden={hidden}"))
        stats_arg = 0
        if stats is not None:
            s_info = arrays.check(stats, "cumulative_local_expert_recv_stats", dtype="int32", shape=(e // r,),
                                  device=dev)
            stats_arg = arrays.kernel_arg(stats, s_info, "cumulative_local_expert_recv_stats")
        plan = ll.dispatch_plan(x_info.framework, num_tokens, num_topk, use_fp8, round_scale, use_ue8m0)
        return (self._remember(key, plan), arrays.kernel_arg(x, x_info, "x"),
                arrays.kernel_arg(topk_idx, k_info, "topk_idx"), stats_arg)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> Any:
        """A [L, R*max, H] bf16 array for the expert outputs of the next low_latency_combine (zero_copy=True).

        epjit's combine reads y in place wherever it lives, so this saves no copy: it exists so DeepEP code runs
        unchanged. Two arrays alternate with the buffer sets (allocated on first use).
        """
        ll = self._low_latency()
        ll.check_handle(handle, id(self))
        return arrays.from_cupy(ll.next_combine_buffer(handle), handle.meta.framework)

    def low_latency_combine(self, y: Any, topk_idx: Any, topk_weights: Any, handle: LowLatencyHandle,
                            zero_copy: bool = False, out: Any = None, return_recv_hook: bool = False,
                            async_finish: bool = False) -> LowLatencyCombineResult:
        """For each token: sum over k with topk_idx[t, k] >= 0 of topk_weights[t, k] * (expert output of the row
        that answered (t, k)), in float32, as bf16 [N, H] (docs/api.md: low-latency combine).

        y is [L, R*max, H] bf16 in the layout the dispatch delivered; topk_idx/topk_weights are what this rank
        dispatched with. ``out`` receives the result if given.
        """
        ll = self._ll if not self._closed else None
        if ll is None:
            ll = self._low_latency()  # raises what is wrong
        ll.raise_status()
        ll.check_handle(handle, id(self))
        key = ("ll_combine", fingerprint(y), fingerprint(topk_idx), fingerprint(topk_weights), fingerprint(out),
               handle.num_topk, handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        plan = self._plans.get(key)
        if plan is None:
            plan, y_arg, idx_arg, w_arg, out_arg = self._low_latency_combine_plan(key, ll, y, topk_idx,
                                                                                  topk_weights, out, handle)
        elif plan.torch:
            y_arg, idx_arg, w_arg = y.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr()
            out_arg = out.data_ptr() if out is not None else 0
        else:
            y_arg, idx_arg, w_arg, out_arg = address(y), address(topk_idx), address(topk_weights), address(out)
        if check_flag(zero_copy, "zero_copy") and not ll.is_combine_buffer(
                y_arg if isinstance(y_arg, int) else y_arg.data.ptr):
            raise ArgumentError(with_rank("zero_copy=True needs y from get_next_low_latency_combine_buffer(handle)"))
        return ll.combine(plan, handle, y, y_arg, topk_idx, idx_arg, topk_weights, w_arg, out, out_arg,
                          check_flag(return_recv_hook, "return_recv_hook"), check_flag(async_finish, "async_finish"))

    def _low_latency_combine_plan(self, key: tuple[Any, ...], ll: LowLatency, y: Any, topk_idx: Any,
                                  topk_weights: Any, out: Any, handle: LowLatencyHandle) -> tuple[Any, ...]:
        dev = self._device
        m, hidden, e, r = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts, self.num_ranks
        y_info = arrays.check(y, "y", dtype="bfloat16", shape=(e // r, r * m, hidden),
                              shape_note="as the dispatch delivered", device=dev)
        k_info = arrays.check(topk_idx, "topk_idx", dtype="int64", shape=("N", ("K", handle.num_topk)),
                              shape_note="as dispatched", device=dev)
        num_tokens = k_info.shape[0]
        if num_tokens > m:
            raise ArgumentError(with_rank(f"topk_idx has {num_tokens} tokens but num_max_dispatch_tokens_per_rank={m}"))
        w_info = arrays.check(topk_weights, "topk_weights", dtype="float32",
                              shape=(("N", num_tokens), ("K", handle.num_topk)), shape_note="matching topk_idx",
                              device=dev)
        out_arg = None
        if out is not None:
            o_info = arrays.check(out, "out", dtype="bfloat16", shape=(("N", num_tokens), ("H", hidden)), device=dev)
            out_arg = arrays.kernel_arg(out, o_info, "out")
        plan = ll.combine_plan(y_info.framework, num_tokens, handle.num_topk)
        return (self._remember(key, plan), arrays.kernel_arg(y, y_info, "y"),
                arrays.kernel_arg(topk_idx, k_info, "topk_idx"),
                arrays.kernel_arg(topk_weights, w_info, "topk_weights"), out_arg)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int | None = None, hidden: int | None = None,
                                 num_experts: int | None = None) -> None:
        """Collective: forget every low-latency call (epochs, signals, pending hooks), e.g. after an error that
        left ranks out of step. Every rank must call it, with no low-latency work in flight. The sizes, if given
        (DeepEP's signature), must be the Buffer's."""
        self._check_open()
        if self._ll is None:
            raise EpjitError(with_rank("this Buffer was not made with low_latency_mode=True"))
        given = tuple(value if value is None else check_int(value, name, 1) for name, value in (
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
            ("num_experts", num_experts)))
        mine = (self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)
        if any(g is not None and g != m for g, m in zip(given, mine, strict=True)):
            raise ArgumentError(with_rank(f"clean_low_latency_buffer{given}: this Buffer was made for {mine} "
                                          "(num_max_dispatch_tokens_per_rank, hidden, num_experts)"))
        self.mem.synchronize(self.comm_stream)
        self.group.barrier()
        self._ll.clean()
        self.group.barrier()


__all__ = ["Buffer", "CombineResult", "Config", "DispatchHandle", "DispatchLayout", "DispatchResult", "Event",
           "LowLatencyCombineResult", "LowLatencyDispatchResult", "LowLatencyHandle"]
