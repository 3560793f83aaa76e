"""Buffer: the user API of epjit: the arguments every call shares are validated here, and each call is delegated to
its family's front object (epjit.front), which owns the family's checks and its plan cache, and from there to the
kernel family (epjit.ops).

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

from dataclasses import replace
from typing import Any

from .config import Config, rdma_size_hint
from .env import settings
from .errors import ArgumentError, ArgumentTypeError, EpjitError, SetupError, check_flag, check_int, with_rank
from .front import (
    CLOSED,
    Absent,
    InternodeFront,
    LowLatencyFront,
    Resources,
    both_modes,
    checked_sizes,
    fronts,
    nvl_size_hint,
)
from .group import Group
from .kernels import BarrierSpec
from .kernels.low_latency import low_latency_size_hint
from .memory import PeerMemory, symmetric_memory
from .ops.layout import DispatchLayout
from .ops.loader import load
from .ops.low_latency import LowLatencyCombineResult, LowLatencyDispatchResult, LowLatencyHandle
from .ops.normal import CombineResult, DispatchHandle, DispatchResult
from .ops.profile import Profile, RoleSummary
from .ops.streams import Event, Outputs, Streams


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
                 num_experts: int = 0, enable_shrink: bool = False) -> None:
        """``enable_shrink=True``: a rank that fails is masked instead of stopping the job (docs/reliability.md:
        shrink mode), in the low-latency calls of a low-latency Buffer, in the normal-mode calls of a normal-mode
        Buffer inside one NVLink node."""
        if not isinstance(group, Group):
            group = _group_of(group)
        # As ints, before any collective or GPU work: "1GB", 1.5 or True is no size (int() would make one of them).
        num_nvl_bytes, num_rdma_bytes, self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts = (
            check_int(value, f"Buffer({name}=...)") for name, value in (
                ("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes),
                ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
                ("num_experts", num_experts)))
        self.low_latency_mode = check_flag(low_latency_mode, "Buffer(low_latency_mode=...)")
        self.enable_shrink = check_flag(enable_shrink, "Buffer(enable_shrink=...)")
        if self.enable_shrink and not self.low_latency_mode:
            if group.num_nvl_ranks != group.size:
                raise ArgumentError(with_rank(
                    f"Buffer(enable_shrink=True) in normal mode masks ranks inside one NVLink node, and this group "
                    f"spans {group.size // group.num_nvl_ranks} nodes: across nodes, enable_shrink needs "
                    "low_latency_mode=True"))
            if not num_nvl_bytes:
                raise ArgumentError(with_rank("Buffer(enable_shrink=True) masks ranks in the normal-mode calls, and "
                                              "this Buffer has none (num_nvl_bytes=0)"))
        group.check_same("Buffer(num_nvl_bytes, num_rdma_bytes, low_latency_mode, enable_shrink)",
                         (num_nvl_bytes, num_rdma_bytes, self.low_latency_mode, self.enable_shrink))
        if group.device is None:
            raise SetupError(with_rank("epjit.Buffer needs a GPU, and epjit.init() bound none on this rank"))
        self.group, self.num_ranks, self.rank = group, group.size, group.rank
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, checked_sizes(
            group, num_nvl_bytes, num_rdma_bytes, self.low_latency_mode, self.num_max_dispatch_tokens_per_rank,
            self.hidden, self.num_experts)
        env = settings()  # read once: the environment is not re-read on the hot path
        where = symmetric_memory(group, env.ll_force_puts, env.one_node_nvshmem, env.rdma_by_stores)
        self.mem = PeerMemory.create(group, self.num_nvl_bytes, self.num_rdma_bytes, symmetric=where)
        try:
            streams = Streams(group.device)
            self._profile = Profile(env.profile)
            res = Resources(group, self.mem, streams, Outputs(streams, group.device, env.poison_outputs),
                            self._profile, env, id(self), self.num_nvl_bytes, self.num_rdma_bytes,
                            self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts,
                            self.enable_shrink)
            # The families this Buffer runs (epjit.front.fronts chooses them), or Absent: what says why not.
            self._normal, self._low_latency = fronts(res, self.low_latency_mode)
        except BaseException:
            self.mem.close()
            raise
        self.comm_stream = streams.comm
        self._closed = False

    def _add_low_latency(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int,
                         enable_shrink: bool = False) -> None:
        """Collective: give a normal-mode Buffer across NVLink nodes low-latency mode for these sizes, as if it had
        been made with low_latency_mode=True: its region the heap's last get_low_latency_size_hint bytes, normal
        mode's later calls the heap before them (epjit.deep_ep, whose Buffers learn the low-latency sizes at their
        first low-latency call). Waits for every rank's normal-mode work, which may have used those bytes."""
        if self._closed:
            raise EpjitError(with_rank(CLOSED))
        normal = self._normal
        if self.low_latency_mode or not isinstance(normal, InternodeFront):
            raise EpjitError(with_rank("only a normal-mode Buffer across NVLink nodes takes low-latency mode later"))
        sizes = tuple(check_int(value, name, 1) for name, value in (
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
            ("num_experts", num_experts)))
        checked_sizes(self.group, self.num_nvl_bytes, self.num_rdma_bytes, True, *sizes)
        self.mem.synchronize(self.comm_stream)
        self.group.barrier()  # no rank's normal-mode kernel still writes into the region
        res = replace(normal.res, num_max_dispatch_tokens_per_rank=sizes[0], hidden=sizes[1], num_experts=sizes[2],
                      enable_shrink=check_flag(enable_shrink, "enable_shrink"))
        normal_res, low_latency_res = both_modes(res)
        low_latency = LowLatencyFront(low_latency_res)
        try:
            low_latency.ops.clean()  # the region zeroed, as a new heap is
            self.group.barrier()  # every rank's before any rank's first low-latency call writes to it
        except BaseException:
            low_latency.close()
            raise
        normal.res = replace(normal.res, low_latency_heap_bytes=normal_res.low_latency_heap_bytes)
        normal.plans.clear()  # checked against the whole heap
        self._low_latency, self.low_latency_mode, self.enable_shrink = low_latency, True, res.enable_shrink
        self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts = sizes

    # ------------------------------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Collective: wait for this Buffer's work, then release the peer memory on every rank. What a refused or
        wrong earlier call found and no call has raised yet is raised here, once everything is released."""
        if self._closed:
            return
        self._closed = True
        families = (self._normal, self._low_latency)
        self._normal = self._low_latency = Absent(CLOSED)
        refusal: ArgumentError | None = None
        try:
            self.mem.synchronize(self.comm_stream)
            try:
                for family in families:
                    family.check()
            except ArgumentError as e:
                refusal = e
        finally:
            for family in families:
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
        return nvl_size_hint(num_ranks, hidden, num_topk, num_experts, config, num_nvl_ranks)

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

    def profile_roles(self) -> list[RoleSummary]:
        """The last call's kernels role by role (needs EPJIT_PROFILE=1; across nodes dispatch and combine stamp a
        row a (channel, role)): for each role, when it started, first and last worked and was done, its channels'
        active time and what its waiters waited, in microseconds (epjit.ops.profile.RoleSummary)."""
        return self._profile.roles()

    @property
    def low_latency_num_sms(self) -> int:
        """Blocks a low-latency kernel runs on (one an SM; ``EPJIT_LL_NUM_SMS`` caps them), 0 without low-latency
        mode: what the benchmark reports beside its low-latency rows."""
        return self._low_latency.ops.num_sms if self.low_latency_mode and not self._closed else 0

    def barrier(self) -> None:
        """A device-side barrier of every rank of the NVLink node, on the communication stream (waits for it)."""
        if self._closed:
            raise EpjitError(with_rank(CLOSED))
        module = load(BarrierSpec(self.group.num_nvl_ranks), self.group.device)
        module.launch(module.spec.args("nvl_barrier", peers=self.mem.table_ptr), 1, 32, stream=self.comm_stream)
        self.mem.synchronize(self.comm_stream)

    def local_memory(self, symmetric: bool = False) -> tuple[int, int]:
        """(device address, bytes) of this rank's own NVLink buffer (its num_nvl_bytes, after the control words) or,
        with ``symmetric=True``, of its symmetric region (num_rdma_bytes; across NVLink nodes with both modes, both
        regions): raw memory the kernels use during their calls and keep state in between (epjit.deep_ep's
        get_local_buffer_tensor hands it out as DeepEP's does)."""
        if self._closed:
            raise EpjitError(with_rank(CLOSED))
        if check_flag(symmetric, "symmetric"):
            if self.mem.sym is None:
                raise ArgumentError(with_rank("this Buffer has no symmetric region (num_rdma_bytes=0)"))
            return self.mem.sym.base, self.mem.sym.num_bytes
        if self.mem.nvl is None:
            raise ArgumentError(with_rank("this Buffer has no NVLink buffer (num_nvl_bytes=0)"))
        return self.mem.nvl_payload_ptr(), self.num_nvl_bytes

    def synchronize(self) -> None:
        """Wait for all of this Buffer's work; raises EpjitTimeoutError if a kernel gave up waiting, and what a
        refused or wrong earlier call found that no call has raised yet."""
        self.mem.synchronize(self.comm_stream)
        self._normal.check()
        self._low_latency.check()

    def xla_site(self, call: str, **sizes: Any) -> Any:
        """One call site of ``call`` ("low_latency_dispatch", "low_latency_combine", "dispatch" or "combine") inside
        an XLA program, for epjit.jax: its static sizes checked as the eager call checks them, its plan fixed, and a
        launch on XLA's stream into XLA's buffers (epjit.ops.xla)."""
        if call.startswith("low_latency_"):
            return self._low_latency.xla_site(call[len("low_latency_"):], **sizes)
        if call == "dispatch":
            return self._normal.xla_dispatch_site(**sizes)
        return self._normal.xla_combine_site(**sizes)

    # ------------------------------------------------------------------------------------------------ normal mode

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Event | None = None,
                            async_finish: bool = False) -> DispatchLayout:
        """Counts per rank and per expert, and is_token_in_rank, for topk_idx [N, K] int64 (-1 = no expert)."""
        return self._normal.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish)

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
        return self._normal.dispatch(x, topk_idx, topk_weights, layout, handle, num_worst_tokens, expert_alignment,
                                     config, previous_event, async_finish, num_experts)

    def combine(self, y: Any, handle: DispatchHandle, topk_weights: Any = None, bias: Any = None,
                config: Config | None = None, previous_event: Event | None = None,
                async_finish: bool = False, *, use_fp8: bool = False) -> CombineResult:
        """For each original token, the sum of the rows the ranks send back for it (+ bias): dispatch's adjoint.
        ``use_fp8=True`` (hidden % 128 == 0): the rows travel as e4m3 with a float32 scale a 128 channels and are
        summed in float32 from their dequantised values; across NVLink nodes, each node's float32 partial crosses
        the network that way (docs/api.md: combine)."""
        return self._normal.combine(y, handle, topk_weights, bias, config, previous_event, async_finish, use_fp8)

    # ------------------------------------------------------------------------------------------------ low latency

    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             return_recv_hook: bool = False, async_finish: bool = False,
                             cumulative_local_expert_recv_stats: Any = None,
                             dispatch_wait_recv_cost_stats: Any = None) -> LowLatencyDispatchResult:
        """Send each (token, chosen expert) straight to a fixed slot of the expert's rank (docs/api.md: low-latency
        dispatch). x is [N, H] bf16 with N <= num_max_dispatch_tokens_per_rank; topk_idx [N, K] int64, -1 = none.

        Returns x [L, R*max, H] (FP8 with x_scales [L, R*max, H/128], or bf16), recv_count [L], and a handle for
        low_latency_combine. With return_recv_hook the send half runs now and ``result.hook()`` runs the receive
        half; the arrays are valid after it. ``dispatch_wait_recv_cost_stats`` (int64 [R]): the nanoseconds this
        call waited for each source's counts are added to it (docs/api.md).
        """
        return self._low_latency.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                                          round_scale, use_ue8m0, return_recv_hook, async_finish,
                                          cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> Any:
        """A [L, R*max, H] bf16 array for the expert outputs of the next low_latency_combine (zero_copy=True).

        epjit's combine reads y in place wherever it lives, so this saves no copy: it exists so DeepEP code runs
        unchanged. Two arrays alternate with the buffer sets (allocated on first use).
        """
        return self._low_latency.next_combine_buffer(handle)

    def low_latency_combine(self, y: Any, topk_idx: Any, topk_weights: Any, handle: LowLatencyHandle,
                            zero_copy: bool = False, out: Any = None, return_recv_hook: bool = False,
                            async_finish: bool = False, *, use_logfmt: bool = False,
                            combine_wait_recv_cost_stats: Any = None) -> LowLatencyCombineResult:
        """For each token: sum over k with topk_idx[t, k] >= 0 of topk_weights[t, k] * (expert output of the row
        that answered (t, k)), in float32, as bf16 [N, H] (docs/api.md: low-latency combine).

        y is [L, R*max, H] bf16 in the layout the dispatch delivered; topk_idx/topk_weights are what this rank
        dispatched with. ``out`` receives the result if given. ``use_logfmt=True``: the rows travel as DeepEP's
        LogFMT-10 (10 bits a value per 128-channel group where the group allows it, bf16 where not).
        ``combine_wait_recv_cost_stats`` (int64 [R]): the nanoseconds waited for each rank's rows are added to it.
        """
        return self._low_latency.combine(y, topk_idx, topk_weights, handle, zero_copy, out, return_recv_hook,
                                         async_finish, use_logfmt, combine_wait_recv_cost_stats)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int | None = None, hidden: int | None = None,
                                 num_experts: int | None = None) -> None:
        """Collective: forget every low-latency call (epochs, signals, pending hooks), e.g. after an error that
        left ranks out of step. Every rank must call it, with no low-latency work in flight. The sizes, if given
        (DeepEP's signature), must be the Buffer's."""
        self._low_latency.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    # ------------------------------------------------------------------------------------------------ shrink mode

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Shrink mode: mask ``rank_to_mask`` (``mask=True``: neither sent to nor waited for by this rank's
        low-latency calls, its experts' terms of combine zero) or unmask it (``mask=False``), from this rank's next
        call on."""
        self._low_latency.update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: Any) -> None:
        """Shrink mode: write the mask into ``mask_status`` ([num_ranks] int32 on this rank's GPU; 1 = masked,
        by this rank's update or by one of its waits that timed out), ordered after this Buffer's calls."""
        self._low_latency.query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Shrink mode: unmask every rank (and forget the reports of the waits that masked them)."""
        self._low_latency.clean_mask()

    def update_mask(self, rank_to_mask: int, mask: bool = True) -> None:
        """Shrink mode, either mode: mask ``rank_to_mask`` (neither sent to nor waited for by this rank's calls; its
        experts' terms of combine zero) or unmask it (``mask=False``), from this rank's next call on. In normal mode
        every live rank masks it (notify also spreads a mask to every live rank); a rank masks its peers only."""
        self._shrinking().update_mask(rank_to_mask, mask)

    def query_mask(self, mask_status: Any) -> None:
        """Shrink mode: write this rank's mask into ``mask_status`` ([num_ranks] int32 on this rank's GPU; 1 =
        masked, by an update, by a wait that timed out, or, in normal mode, by a live peer's mask), ordered after
        this Buffer's calls."""
        self._shrinking().query_mask(mask_status)

    def clean_mask(self) -> None:
        """Shrink mode: unmask every rank (and forget the reports). In normal mode a collective of every rank of the
        group, all live, between calls: it also zeroes the barrier words a rank that left may have left."""
        self._shrinking().clean_mask()

    def mask_reports(self) -> list[dict[str, Any]]:
        """Shrink mode: for each rank a wait of this rank masked since the last clean, what the wait recorded:
        ``rank`` (this rank), ``peer`` (the rank masked), ``site`` (kernel and what was awaited), ``channel``,
        ``expected``, ``observed``, ``elapsed_ns``. Each is also logged once as a warning."""
        return self._shrinking().mask_reports()

    def _shrinking(self) -> Any:
        """The family whose calls this Buffer's mask governs: low latency on a low-latency Buffer, else normal."""
        return self._low_latency if self.low_latency_mode else self._normal

    def low_latency_mask_reports(self) -> list[dict[str, Any]]:
        """Shrink mode: for each rank a wait of this rank masked since the last clean_mask_buffer, what the wait
        recorded: ``rank`` (this rank), ``peer`` (the rank masked), ``site`` (kernel and what was awaited),
        ``channel``, ``expected``, ``observed``, ``elapsed_ns``. Each is also logged once as a warning."""
        return self._low_latency.mask_reports()


__all__ = ["Buffer", "CombineResult", "Config", "DispatchHandle", "DispatchLayout", "DispatchResult", "Event",
           "LowLatencyCombineResult", "LowLatencyDispatchResult", "LowLatencyHandle"]
