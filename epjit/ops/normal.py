"""What both normal-mode families (epjit.ops.intranode, epjit.ops.internode) hand across the boundary: the typed
record of each operation's inputs, the plans (one shape of a call, validated), the handle and the results.

Inputs are the arrays as the kernels take them (epjit.arrays.kernel_array: the caller's torch tensor or CuPy
array, a CuPy view for JAX); each carries its own address (epjit.arrays.address) and framework, so no (array,
address) pairs travel. A plan's ``kind`` says where its outputs come from (epjit.ops.streams.Outputs): "torch" or
"cupy", the same word in every family.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import jit
from .layout import MadeLayout
from .streams import Event


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


@dataclass(slots=True)
class DispatchInputs:
    """One dispatch's arrays, as the kernels take them (kept referenced while the kernels may read them).

    The inputs records of every family are refilled by each call and read during that call only (as a plan's
    kernel arguments are): a front owns one of each, so a call allocates no record."""

    x: Any = None  # [N, H] bf16, or FP8 with x_scales
    x_scales: Any = None  # [N, H/128] float32, or None
    topk_idx: Any = None  # or None
    topk_weights: Any = None  # or None


@dataclass(slots=True)
class CombineInputs:
    """One combine's arrays, as the kernels take them (refilled by each call, as DispatchInputs)."""

    y: Any = None
    topk_weights: Any = None  # or None
    bias0: Any = None  # or None
    bias1: Any = None  # or None


class LayoutInputs(NamedTuple):
    """A layout's kernel arguments (addresses) and what keeps is_token_in_rank alive."""

    per_rank: int
    per_expert: int
    in_rank: int
    in_rank_owner: Any
    invalid: int
    keep: tuple[Any, ...]  # arrays an async torch call must mark as used on the communication stream
    per_node: int = 0  # num_tokens_per_rdma_rank, across nodes


class DispatchShape(NamedTuple):
    """One shape of dispatch, validated by the front (epjit.front.normal): what its plan is built from."""

    framework: str  # the caller's
    kind: str  # allocation kind (streams.Outputs)
    num_tokens: int
    hidden: int
    num_topk: int
    fp8: bool
    with_weights: bool
    with_idx: bool
    num_experts: int
    num_worst_tokens: int
    expert_alignment: int
    replay: bool  # a handle's routing replayed: notify exchanges no per-expert counts


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
