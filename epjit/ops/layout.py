"""get_dispatch_layout: from topk_idx to the counts every normal-mode dispatch needs (cuda_src/layout.cu).

One allocation holds a layout's outputs:

    | num_tokens_per_rank | num_tokens_per_expert | num_tokens_per_rdma_rank | invalid_ids | is_token_in_rank |
    | R x int32           | E x int32             | nodes x int32 (or none)  | 1 x int32   | N x R bool       |

each part 256-byte aligned; num_tokens_per_rdma_rank (tokens bound for each NVLink node, a token once a node) only
where the group has more than one node.

With several blocks the kernel adds into the counts, which the host zeroes first; a single block (up to 256
tokens) stores them whole, and the host skips the memset. Every row of is_token_in_rank is written whole.
Dispatch reads a layout get_dispatch_layout made through these addresses; the caller's arrays (views of the
allocation) are made the first time they are read. ``invalid_ids`` counts top-k entries outside [-1, E) the kernel
skipped; the next dispatch's notify reports them on every rank (no host synchronisation here, so the layout can be
captured in a CUDA graph).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import jit
from ..arrays import address
from ..kernels import LayoutSpec
from .loader import load
from .streams import Event, Outputs, Streams, caller_stream

_BLOCK = 256  # threads of the layout kernel: one a token
_ALIGN = 256


def _up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(eq=False, slots=True)
class MadeLayout:
    """The allocation get_dispatch_layout wrote, and where each part of it is."""

    owner: Any  # uint8: a torch tensor or a CuPy array
    kind: str  # which (streams.Outputs' allocation kind)
    framework: str  # whose arrays the caller gets
    num_tokens: int
    num_ranks: int
    num_experts: int
    per_rank_ptr: int
    per_expert_ptr: int
    invalid_ptr: int
    in_rank_ptr: int
    num_nodes: int = 1

    @staticmethod
    def offsets(num_tokens: int, num_ranks: int, num_experts: int,
                num_nodes: int = 1) -> tuple[int, int, int, int, int, int]:
        """Byte offsets of num_tokens_per_rank, num_tokens_per_expert, invalid_ids, is_token_in_rank, the total, and
        num_tokens_per_rdma_rank (among the counts, so the memset of the counts zeroes it too)."""
        expert = _up(4 * num_ranks)
        per_node = expert + _up(4 * num_experts)
        invalid = per_node + (_up(4 * num_nodes) if num_nodes > 1 else 0)
        in_rank = invalid + _ALIGN
        return 0, expert, invalid, in_rank, in_rank + _up(num_tokens * num_ranks), per_node

    @property
    def per_node_ptr(self) -> int:
        """Address of num_tokens_per_rdma_rank (0 inside one node)."""
        if self.num_nodes == 1:
            return 0
        return self.per_rank_ptr + self.offsets(self.num_tokens, self.num_ranks, self.num_experts, self.num_nodes)[5]

    def view(self, part: int) -> Any:
        """Part 0 num_tokens_per_rank, 1 num_tokens_per_expert, 2 invalid_ids, 3 is_token_in_rank, 5
        num_tokens_per_rdma_rank (None inside one node)."""
        if part == 5 and self.num_nodes == 1:
            return None
        start = self.offsets(self.num_tokens, self.num_ranks, self.num_experts, self.num_nodes)[part]
        n = (self.num_ranks, self.num_experts, 1, self.num_tokens * self.num_ranks, 0, self.num_nodes)[part]
        raw = self.owner[start:start + (n if part == 3 else 4 * n)]
        torch = sys.modules["torch"] if self.kind == "torch" else None
        if part == 3:
            arr = (raw.view(torch.bool) if torch else raw.view(np.bool_)).reshape(self.num_tokens, self.num_ranks)
        else:
            arr = raw.view(torch.int32) if torch else raw.view(np.int32)
        if self.kind == "torch" or self.framework == "cupy":
            return arr
        from ..arrays import from_cupy

        return from_cupy(arr, self.framework)


class DispatchLayout:
    """What get_dispatch_layout computes, as arrays of the caller's framework: num_tokens_per_rank [R] int32,
    num_tokens_per_rdma_rank [nodes] int32 (None inside one NVLink node), num_tokens_per_expert [E] int32,
    is_token_in_rank [N, R] bool, and the call's event. One made by hand from arrays is checked by dispatch; one
    get_dispatch_layout made is read by dispatch through addresses, and assigning any of its arrays makes it a
    hand-made one."""

    __slots__ = ("_arrays", "event", "made")

    def __init__(self, num_tokens_per_rank: Any = None, num_tokens_per_rdma_rank: Any = None,
                 num_tokens_per_expert: Any = None, is_token_in_rank: Any = None, event: Event | None = None,
                 made: MadeLayout | None = None) -> None:
        self._arrays: list[Any] = [num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                                   is_token_in_rank]
        self.event = event
        self.made = made  # what get_dispatch_layout wrote (None: a layout built by hand)

    def _get(self, i: int, part: int) -> Any:
        if self._arrays[i] is None and self.made is not None:
            self._arrays[i] = self.made.view(part)
        return self._arrays[i]

    def _set(self, i: int, value: Any) -> None:
        for j, part in ((0, 0), (1, 5), (2, 1), (3, 3)):  # a hand-made layout keeps every array the caller can see
            self._get(j, part)
        self._arrays[i] = value
        self.made = None

    num_tokens_per_rank = property(lambda self: self._get(0, 0), lambda self, v: self._set(0, v))
    num_tokens_per_rdma_rank = property(lambda self: self._get(1, 5), lambda self, v: self._set(1, v))
    num_tokens_per_expert = property(lambda self: self._get(2, 1), lambda self, v: self._set(2, v))
    is_token_in_rank = property(lambda self: self._get(3, 3), lambda self, v: self._set(3, v))

    @property
    def invalid_ids(self) -> Any:
        """[1] int32 on the GPU: top-k entries the layout kernel skipped (None for a hand-made layout)."""
        return self.made.view(2) if self.made is not None else None

    def __repr__(self) -> str:
        how = "made by get_dispatch_layout" if self.made is not None else "made by hand"
        return f"DispatchLayout({how}, num_tokens_per_rank={self.num_tokens_per_rank!r})"


@dataclass(eq=False)
class LayoutPlan:
    """One shape of get_dispatch_layout: how much to allocate, the grid, and the launch's constant arguments."""

    framework: str  # the caller's
    kind: str  # allocation kind (streams.Outputs)
    new_owner: Callable[[], Any]  # allocates the layout's one allocation
    num_tokens: int
    num_experts: int
    offsets: tuple[int, int, int, int, int, int]  # MadeLayout.offsets
    counts_bytes: int  # of counts and invalid_ids to zero first (0: the kernel's single block stores them whole)
    grid: int
    shared_bytes: int
    args: jit.KernelArgs


class Layout:
    """The layout kernel of a Buffer."""

    def __init__(self, streams: Streams, outputs: Outputs, device: int, num_ranks: int, num_nvl_ranks: int) -> None:
        self.streams, self.outputs, self.device = streams, outputs, device
        self.num_ranks, self.num_nvl_ranks = num_ranks, num_nvl_ranks
        self.num_nodes = num_ranks // num_nvl_ranks
        self.module = load(LayoutSpec(), device)

    def plan(self, framework: str, kind: str, num_tokens: int, num_topk: int, num_experts: int) -> LayoutPlan:
        nodes = self.num_nodes
        offsets = MadeLayout.offsets(num_tokens, self.num_ranks, num_experts, nodes)
        args = self.module.spec.args("dispatch_layout", num_tokens=num_tokens, num_topk=num_topk,
                                     num_experts=num_experts, num_ranks=self.num_ranks,
                                     num_nvl_ranks=self.num_nvl_ranks)
        grid = max(1, (num_tokens + _BLOCK - 1) // _BLOCK)  # no tokens: one block still stores the zero counts
        new_owner = self.outputs.allocator(kind, (offsets[4],), self.outputs.dtype(kind, "uint8"))
        return LayoutPlan(framework, kind, new_owner, num_tokens, num_experts, offsets,
                          offsets[3] if grid > 1 else 0, grid, 4 * (num_experts + self.num_ranks + nodes + 1), args)

    def run(self, plan: LayoutPlan, idx: Any, previous_event: Event | None, async_finish: bool) -> DispatchLayout:
        """Count topk_idx (as the kernels take it: epjit.arrays.kernel_array) into a new layout."""
        caller = caller_stream(plan.framework, self.device)
        streams, kind, offsets = self.streams, plan.kind, plan.offsets
        # The layout kernel reads topk_idx and writes only this call's outputs, and touches no peer memory: where the
        # caller waits for it anyway (no previous_event, no async_finish) and torch allocated the outputs on the
        # caller's stream, it runs there, in order with the caller's work, and no event needs recording. CuPy's
        # outputs belong to the communication stream's pool, and poisoned outputs are filled on that stream: the
        # kernel then runs there too.
        on_caller = kind == "torch" and previous_event is None and not async_finish and not self.outputs.poison
        if not on_caller:
            streams.begin(caller, previous_event)
        stream = caller if on_caller else streams.comm_ptr
        owner = plan.new_owner()
        base = address(owner)
        nodes = self.num_nodes
        made = MadeLayout(owner, kind, plan.framework, plan.num_tokens, self.num_ranks, plan.num_experts, base,
                          base + offsets[1], base + offsets[2], base + offsets[3], nodes)
        if plan.counts_bytes:
            _memset_async()(base, 0, plan.counts_bytes, stream)
        args = plan.args.set(topk_idx=address(idx), num_tokens_per_rank=base, num_tokens_per_expert=made.per_expert_ptr,
                             num_tokens_per_rdma_rank=base + offsets[5] if nodes > 1 else 0,
                             is_token_in_rank=made.in_rank_ptr, invalid_ids=made.invalid_ptr)
        self.module.launch(args, plan.grid, _BLOCK, shared_mem=plan.shared_bytes, stream=stream)
        if on_caller:
            return DispatchLayout(event=Event(None, caller), made=made)
        event = streams.finish(caller, async_finish)
        if async_finish and kind == "torch":
            streams.used_by_comm((idx, owner))
        return DispatchLayout(event=event, made=made)


_MEMSET: Any = None


def _memset_async() -> Any:
    global _MEMSET
    if _MEMSET is None:
        import cupy

        _MEMSET = cupy.cuda.runtime.memsetAsync
    return _MEMSET
