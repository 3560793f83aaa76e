"""The normal-mode handle as DeepEP's tuple: ``dispatch`` returns a :class:`NormalHandle`, which combine and a
cached dispatch take back as it is, and which callers index and unpack as DeepEP's handle (``handle[0]``, intranode's
``rank_prefix_matrix``; ``handle[-4]``, internode's ``recv_gbl_rank_prefix_sum``).

DeepEP's items, in its order, and what each is made from (docs/deep_ep.md)::

    intranode (6)                              epjit's DispatchHandle
    rank_prefix_matrix          [R, R]         rank_prefix_matrix (the same)
    channel_prefix_matrix       [R, C]         channel_prefix_matrix (the same: inclusive over my channels)
    recv_channel_prefix_matrix  [R, C]         recv_channel_offset (the same: first row of (source, channel))
    recv_src_idx                [rows]         recv_src_idx (the same)
    is_token_in_rank            [N, R] bool    is_token_in_rank (the one the dispatch read)
    send_head                   [N, R]         send_head, every negative entry as -1 (DeepEP's value after dispatch)

    internode (10)                             epjit's InternodeHandle arrays
    is_token_in_rank            [N, R] bool    is_token_in_rank
    rdma_channel_prefix_matrix  [nodes, C]     rdma_channel_prefix (the same)
    gbl_channel_prefix_matrix   [R, C]         channel_prefix_matrix (the same)
    recv_rdma_channel_prefix_matrix [nodes, C] recv_rdma_channel: first + count - fwd_node_prefix (end in the node's)
    recv_rdma_rank_prefix_sum   [nodes]        fwd_node_prefix + the node's forwarded tokens (inclusive)
    recv_gbl_channel_prefix_matrix [R, C]      recv_channel_offset (the same)
    recv_gbl_rank_prefix_sum    [R]            recv_rank_prefix[1:] (inclusive)
    recv_src_meta               None           no counterpart: epjit keeps recv_src_idx instead
    send_rdma_head              [N, nodes]     send_rdma_head, negatives as -1
    send_nvl_head               [fwd, V]       send_nvl_head, negatives as -1 (V columns, DeepEP's has 8)

The tensors are made on the first read, on torch's current stream (read them where the dispatch's outputs are
valid); dispatch and combine never make them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

INTRANODE_ITEMS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                   "is_token_in_rank", "send_head")
INTERNODE_ITEMS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                   "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                   "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")


def _tensor(array: Any) -> Any:
    """A torch tensor over ``array``'s memory (CuPy through __cuda_array_interface__, NumPy on the CPU)."""
    return sys.modules["torch"].as_tensor(array)


def _heads(array: Any) -> Any:
    """A send head as DeepEP's dispatch leaves it: the slot index, or -1 where the token was not sent (epjit keeps
    -(next index)-1 there, which DeepEP's combine writes itself before it reads them)."""
    return _tensor(array).clamp(min=-1)


def _is_internode(handle: Any) -> bool:
    from ..ops.internode import InternodeHandle

    return isinstance(handle, InternodeHandle)


def _intranode_items(h: Any) -> tuple[Any, ...]:
    return (_tensor(h.rank_prefix_matrix), _tensor(h.channel_prefix_matrix), _tensor(h.recv_channel_offset),
            _tensor(h.recv_src_idx), _tensor(h.is_token_in_rank), _heads(h.send_head))


def _internode_items(h: Any) -> tuple[Any, ...]:
    torch = sys.modules["torch"]
    fwd_node_prefix = _tensor(h.array("fwd_node_prefix"))
    forwarded = _tensor(h.array("recv_rdma_channel")).reshape(fwd_node_prefix.shape[0], -1, 2)
    channel_end = forwarded[..., 0] + forwarded[..., 1] - fwd_node_prefix[:, None]
    node_end = (fwd_node_prefix + forwarded[..., 1].sum(dim=-1)).to(torch.int32)
    return (_tensor(h.is_token_in_rank), _tensor(h.array("rdma_channel_prefix")),
            _tensor(h.array("channel_prefix_matrix")), channel_end.to(torch.int32), node_end,
            _tensor(h.array("recv_channel_offset")), _tensor(h.array("recv_rank_prefix"))[1:], None,
            _heads(h.array("send_rdma_head")), _heads(h.array("send_nvl_head")))


class NormalHandle:
    """What ``dispatch`` returns as its handle: DeepEP's tuple (6 items inside one NVLink node, 10 across nodes,
    in DeepEP's order and meaning; this module's docstring has the table), made when first read. ``.handle`` is
    epjit's :class:`~epjit.DispatchHandle`; combine and a cached dispatch take this object back as it is (a tuple
    rebuilt from its items is not a handle)."""

    __slots__ = ("_items", "handle")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._items: tuple[Any, ...] | None = None

    def items(self) -> tuple[Any, ...]:
        """DeepEP's items as a tuple of torch tensors (``recv_src_meta`` is None: epjit has no counterpart)."""
        if self._items is None:
            h = self.handle
            self._items = _internode_items(h) if _is_internode(h) else _intranode_items(h)
        return self._items

    def names(self) -> tuple[str, ...]:
        """DeepEP's names of the items, in order."""
        return INTERNODE_ITEMS if _is_internode(self.handle) else INTRANODE_ITEMS

    def __len__(self) -> int:
        return len(self.names())

    def __getitem__(self, i: Any) -> Any:
        return self.items()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items())

    def __repr__(self) -> str:
        return f"NormalHandle({self.handle!r})"
