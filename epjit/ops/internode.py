"""Normal mode across NVLink nodes (cuda_src/internode.cu): notify over RDMA then NVLink, dispatch through RDMA rings
to a forwarder on each destination node and NVLink rings to the final rank, combine backwards with a partial sum at
each forwarder.

The flow of a call is intranode's (epjit.ops.intranode.Intranode, whose steps this family redoes where they
differ): outputs allocated before the counts, notify's host record, a retry when an estimate was short, worst-token
mode without host synchronisation. What differs: a capacity is two numbers (rows received, tokens this rank
forwards), the record also lists the tokens every rank forwards, a handle keeps more arrays, and a replay exchanges
its dispatch's counts again (kept in the handle) instead of skipping the exchange.

A notify host record (mapped host memory, int32; docs/layouts.md):

    [0] rows this rank receives (-1 until notify writes it, last)   [1] status bits (intranode's)
    [2 .. 2 + 8R)   every rank's meta: hidden, num_experts, num_topk, flags, recv_capacity, fwd_capacity,
                    num_tokens, config tag
    [.. + R)        rows each rank receives      [.. + R) tokens each rank forwards
    [.. + E/R)      tokens received per local expert (rounded up to expert_alignment)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..arrays import address
from ..config import Config
from ..jit import KernelArgs, KernelSpec, Module
from ..kernels.internode import (
    NOTIFY_TIMELINE_POINTS,
    NUM_THREADS,
    InternodeCombineFp8Spec,
    InternodeNotifySpec,
    InternodeSpec,
    by_stores,
    profile_spec,
    timeline_roles,
)
from ..kernels.intranode import META_INTS
from ..memory import IpcHeap, PeerMemory
from .intranode import Intranode
from .normal import CombinePlan, DispatchHandle, DispatchPlan, DispatchShape, Ints, LayoutInputs
from .notify import RowEstimate, expert_counts_at
from .profile import Profile
from .streams import Outputs, Streams

NOTIFY_THREADS = 256

# The handle's int arrays, in this order (one allocation; docs/layouts.md):
HANDLE_INTS = ("channel_prefix_matrix",  # [R, C] my tokens of channels 0..c for each rank
               "rdma_channel_prefix",  # [N, C] my tokens of channels 0..c for each node
               "recv_rank_prefix",  # [R + 1] rows received before each source's, then all of them
               "fwd_node_prefix",  # [N] tokens I forward from the nodes before each
               "recv_channel_offset",  # [R, C] first received row of (source, channel)
               "recv_channel_count",  # [R, C] rows received of (source, channel)
               "send_rdma_head",  # [N_tokens, N] the token's index in its stream to each node (or -next-1)
               "recv_rdma_channel",  # [N, C, 2] forwarded tokens of (node, channel): first index, count
               "send_nvl_head",  # [forwarded, V] where each forwarded token went in each node peer's ring (or -next-1)
               "recv_src_idx",  # [rows] source token of each received row
               "status",  # [1] notify's status: the dispatch and every combine of the handle do nothing unless 0
               "saved_counts")  # [R + N + E] the dispatch's counts: a replay exchanges them again
_AT = {name: i for i, name in enumerate(HANDLE_INTS)}


def forwarded_at(num_ranks: int) -> int:
    """Where the host record's tokens forwarded by each rank start."""
    return 2 + (META_INTS + 1) * num_ranks


def config_tag(config: Config) -> int:
    """The numbers of a Config the internode kernels' layouts depend on, as one int every rank compares in notify."""
    return (config.num_sms * 1_000_003 + config.nvl_chunk_recv * 10_007 + config.rdma_chunk_send * 101
            + config.rdma_chunk_recv) % (1 << 30)


@dataclass(eq=False, slots=True)
class InternodeHandle(DispatchHandle):
    """A dispatch across nodes, for combine and replays: intranode's fields, its arrays by HANDLE_INTS, and the
    tokens this rank forwarded (-1 when unknown to the host: worst-token mode)."""

    num_forwarded: int = -1

    status_ints = property(lambda self: self.ints[_AT["status"]])
    recv_src_ints = property(lambda self: self.ints[_AT["recv_src_idx"]])
    channel_prefix_ints = property(lambda self: self.ints[_AT["channel_prefix_matrix"]])
    recv_channel_offset_ints = property(lambda self: self.ints[_AT["recv_channel_offset"]])
    send_head_ints = property(lambda self: self.ints[_AT["send_rdma_head"]])
    channel_prefix_matrix = property(lambda self: self.ints[_AT["channel_prefix_matrix"]].view())
    recv_channel_offset = property(lambda self: self.ints[_AT["recv_channel_offset"]].view())
    send_head = property(lambda self: self.ints[_AT["send_rdma_head"]].view())

    @property
    def rank_prefix_ints(self) -> Any:
        raise AttributeError("an internode handle has no rank_prefix_matrix: recv_rank_prefix gives the rows "
                             "received before each source's")

    @property
    def rank_prefix_matrix(self) -> Any:
        return self.rank_prefix_ints

    def array(self, name: str) -> Any:
        """One of the handle's int arrays (HANDLE_INTS), as a CuPy view."""
        return self.ints[_AT[name]].view()

    @property
    def recv_rank_prefix(self) -> Any:
        return self.ints[_AT["recv_rank_prefix"]].view()

    @property
    def recv_src_idx(self) -> Any:
        return self.ints[_AT["recv_src_idx"]].view(self.num_rows)


class Internode(Intranode):
    """Normal mode of a Buffer whose group spans several NVLink nodes: kernels, claims, host records, estimates."""

    FORWARDED = True

    def __init__(self, mem: PeerMemory, streams: Streams, outputs: Outputs, profile: Profile, device: int,
                 num_experts: int, expert_cap: int) -> None:
        group = mem.group
        self.num_nvl_ranks = group.num_nvl_ranks
        self.num_nodes = group.size // group.num_nvl_ranks
        self.expert_cap = expert_cap
        # Virtual nodes on one host with their symmetric region on IPC memory (EPJIT_RDMA_BY_STORES): the kernels'
        # build with the RDMA leg as NVLink stores, and no NVSHMEM.
        self.by_stores = isinstance(mem.sym, IpcHeap)
        super().__init__(mem, streams, outputs, profile, device, num_experts)
        self.forward_estimate = RowEstimate(self.num_nodes)  # tokens this rank forwards, by the same rule as rows

    def _notify_spec(self) -> KernelSpec:
        return self._build(InternodeNotifySpec(self.num_nodes, self.num_nvl_ranks))

    def module(self, spec: InternodeSpec | InternodeCombineFp8Spec) -> Module:
        return super().module(self._build(spec))

    def _build(self, spec: InternodeNotifySpec | InternodeSpec | InternodeCombineFp8Spec) -> KernelSpec:
        """The build of ``spec`` this Buffer runs: with the RDMA leg as stores on IPC memory; with EPJIT_PROFILE=1
        (read when the Buffer was made) the profile build, the only one that stamps its timeline (the production
        kernels take the argument and ignore it: they are the code they were without stamps)."""
        build = by_stores(spec) if self.by_stores else spec
        return profile_spec(build) if self.profile.enabled else build

    # ---------------------------------------------------------------------------------------------------- plans

    def dispatch_plan(self, shape: DispatchShape, spec: InternodeSpec, config: Config) -> DispatchPlan:
        """What a dispatch of this shape needs (its arguments and config already checked by the front)."""
        s = shape
        module = self.module(spec)
        channels, table = config.num_sms // 2, self.mem.table_ptr
        notify = self.notify_module.spec.args(
            "internode_notify", peers=table, num_tokens=s.num_tokens, num_channels=channels, hidden=s.hidden,
            num_topk=s.num_topk, num_experts=s.num_experts, expert_cap=self.expert_cap,
            expert_alignment=s.expert_alignment, config_tag=config_tag(config), layout_fits=1, timeline=0)
        dispatch = module.spec.args(
            "internode_dispatch", peers=table, claims=self.claims[0], num_tokens=s.num_tokens, hidden=s.hidden,
            num_scales=s.hidden // 128 if s.fp8 else 0, num_topk=s.num_topk, num_experts=s.num_experts,
            expert_cap=self.expert_cap, num_channels=channels, rdma_slots=config.rdma_chunk_recv,
            rdma_chunk=config.rdma_chunk_send, nvl_slots=config.nvl_chunk_recv, num_worst_tokens=s.num_worst_tokens,
            timeline=0)
        # num_channels: the Config's SMs, as intranode's (combine's configs are checked against it); the kernels
        # run num_sms / 2 channels of two blocks each.
        return self._plan(s, config.num_sms, notify, dispatch, module)

    def combine_plan(self, framework: str, kind: str, spec: InternodeSpec | InternodeCombineFp8Spec,
                     config: Config, handle: DispatchHandle, with_weights: bool) -> CombinePlan:
        """A combine's plan: bf16 with an InternodeSpec, FP8 partials (internode_combine_fp8) with its own spec."""
        module = self.module(spec)
        kernel = "internode_combine_fp8" if isinstance(spec, InternodeCombineFp8Spec) else "internode_combine"
        args = module.spec.args(
            kernel, peers=self.mem.table_ptr, claims=self.claims[1], num_tokens=handle.num_tokens,
            hidden=handle.hidden, num_topk=handle.num_topk, expert_cap=self.expert_cap,
            num_channels=handle.num_channels // 2, rdma_slots=config.rdma_chunk_recv,
            rdma_chunk=config.rdma_chunk_send, nvl_slots=config.nvl_chunk_recv, nvl_chunk=config.nvl_chunk_send,
            timeline=0)
        return self._combine_plan(framework, kind, handle, with_weights, args, module)

    # ---------------------------------------------------------------------------------------------------- dispatch

    def _capacity(self, plan: DispatchPlan, handle: DispatchHandle | None) -> tuple[tuple[int, ...], bool]:
        """Rows of output and forwarded tokens to allocate before the counts, and whether they are estimates. Under
        num_worst_tokens each forwarded token is a row of some rank of my node, so V x num_worst_tokens holds them
        wherever the rows fit."""
        if plan.num_worst_tokens > 0:
            return (plan.num_worst_tokens, self.num_nvl_ranks * plan.num_worst_tokens), False
        if isinstance(handle, InternodeHandle) and handle.num_recv_tokens >= 0:
            return (handle.num_recv_tokens, handle.num_forwarded), False
        return (self.estimate.rows(plan.num_tokens), self.forward_estimate.rows(plan.num_tokens)), True

    def _counts(self, layout: LayoutInputs | None, handle: DispatchHandle | None) -> tuple[dict[str, Any], Any, Any]:
        """Notify's count arguments: the layout's, or (a replay) the handle's saved copy of its dispatch's."""
        if handle is None:
            assert layout is not None
            return ({"num_tokens_per_rank": layout.per_rank, "num_tokens_per_rdma_rank": layout.per_node,
                     "num_tokens_per_expert": layout.per_expert, "invalid_ids": layout.invalid},
                    layout.in_rank, layout.in_rank_owner)
        saved = handle.ints[_AT["saved_counts"]].ptr
        return ({"num_tokens_per_rank": saved, "num_tokens_per_rdma_rank": saved + 4 * self.num_ranks,
                 "num_tokens_per_expert": saved + 4 * (self.num_ranks + self.num_nodes), "invalid_ids": 0},
                handle.in_rank_ptr, handle.in_rank_owner)

    @staticmethod
    def _replay_record(handle: DispatchHandle | None) -> list[int] | None:
        """Across nodes a replay waits for notify's record: the new handle takes its forwarded tokens from it."""
        return None

    def _exact(self, record: list[int]) -> tuple[int, ...]:
        return record[0], record[forwarded_at(self.num_ranks) + self.mem.group.rank]

    def _saw(self, plan: DispatchPlan, record: list[int]) -> None:
        self.estimate.saw(plan.num_tokens, record[0])
        self.forward_estimate.saw(plan.num_tokens, record[forwarded_at(self.num_ranks) + self.mem.group.rank])

    def _new_handle(self, ints: tuple[Ints, ...], in_rank: int, in_rank_owner: Any, record: list[int],
                    num_rows: int, plan: DispatchPlan, buffer_id: int) -> DispatchHandle:
        known = bool(record)
        return InternodeHandle(ints, in_rank, in_rank_owner, record[0] if known else -1, num_rows, plan, buffer_id,
                               record[forwarded_at(self.num_ranks) + self.mem.group.rank] if known else -1)

    def _ints(self, plan: DispatchPlan, capacity: tuple[int, ...], handle: DispatchHandle | None) -> tuple[Ints, ...]:
        """The handle's arrays (HANDLE_INTS) of one dispatch in one allocation; a replay keeps its handle's counts."""
        r, n, v, c = self.num_ranks, self.num_nodes, self.num_nvl_ranks, plan.num_channels // 2
        rows, forwarded = capacity
        shapes = [(r, c), (n, c), (r + 1,), (n,), (r, c), (r, c), (plan.num_tokens, n), (n, c, 2),
                  (max(forwarded, 1), v), (rows,), (1,)]
        if handle is None:
            return self._carve([*shapes, (r + n + plan.num_experts,)])
        return (*self._carve(shapes), handle.ints[_AT["saved_counts"]])

    def _launch_dispatch(self, plan: DispatchPlan, grid: int, capacity: tuple[int, ...], ints: tuple[Ints, ...],
                         outs: tuple[Any, ...]) -> None:
        comm = self.streams.comm_ptr
        p = {name: part.ptr for name, part in zip(HANDLE_INTS, ints, strict=True)}
        # A replay's counts are its handle's saved copy (another allocation than this call's arrays): notify reads
        # them and keeps no copy of its own.
        replay = ints[_AT["saved_counts"]].owner is not ints[0].owner
        notify = plan.notify_args.set(
            recv_capacity=capacity[0], fwd_capacity=capacity[1], channel_prefix_matrix=p["channel_prefix_matrix"],
            rdma_channel_prefix=p["rdma_channel_prefix"], recv_rank_prefix=p["recv_rank_prefix"],
            fwd_node_prefix=p["fwd_node_prefix"], call_status=p["status"],
            saved_counts=0 if replay else p["saved_counts"])
        if self.profile.enabled:  # (off: the plans' timelines stay 0, no stamps)
            notify.set(timeline=self.profile.timeline("notify", 1 + self.num_ranks + self.num_nodes,
                                                      NOTIFY_TIMELINE_POINTS))
        self.notify_module.launch(notify, 1 + self.num_ranks + self.num_nodes, NOTIFY_THREADS, stream=comm)
        dispatch = plan.dispatch_args.set(
            channel_prefix_matrix=p["channel_prefix_matrix"], rdma_channel_prefix=p["rdma_channel_prefix"],
            recv_rank_prefix=p["recv_rank_prefix"], fwd_node_prefix=p["fwd_node_prefix"], call_status=p["status"],
            recv_x=address(outs[0]), recv_x_scales=address(outs[1]), recv_src_idx=p["recv_src_idx"],
            recv_topk_idx=address(outs[2]), recv_topk_weights=address(outs[3]),
            recv_channel_offset=p["recv_channel_offset"], recv_channel_count=p["recv_channel_count"],
            send_rdma_head=p["send_rdma_head"], recv_rdma_channel=p["recv_rdma_channel"],
            send_nvl_head=p["send_nvl_head"])
        if self.profile.enabled:
            dispatch.set(timeline=self.profile.role_timeline(
                "dispatch", dispatch["num_channels"], timeline_roles(dispatch.spec, "internode_dispatch")))
        plan.module.launch(dispatch, grid, NUM_THREADS, stream=comm)

    def _after_counts(self, plan: DispatchPlan, record: list[int], handle: DispatchHandle | None,
                      num_recv: int) -> list[int]:
        if handle is not None:
            return super()._after_counts(plan, record, handle, num_recv)
        return record[expert_counts_at(self.num_ranks, True):]

    # ---------------------------------------------------------------------------------------------------- combine

    def _combine_timeline(self, args: KernelArgs, plan: CombinePlan) -> None:
        """EPJIT_PROFILE: stamps for this combine launch, a row a (channel, role)."""
        args.set(timeline=self.profile.role_timeline("combine", args["num_channels"],
                                                     timeline_roles(args.spec, args.kernel)))

    @staticmethod
    def _handle_args(handle: DispatchHandle) -> dict[str, int]:
        p = {name: part.ptr for name, part in zip(HANDLE_INTS, handle.ints, strict=True)}
        return {"rdma_channel_prefix": p["rdma_channel_prefix"], "recv_channel_offset": p["recv_channel_offset"],
                "recv_channel_count": p["recv_channel_count"], "send_rdma_head": p["send_rdma_head"],
                "recv_rdma_channel": p["recv_rdma_channel"], "send_nvl_head": p["send_nvl_head"],
                "dispatch_status": p["status"]}
