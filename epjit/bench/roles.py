"""The internode kernels role by role (``--profile`` across NVLink nodes): the bytes each role of this rank moves in a
call, from the routing, beside when it worked and what it waited for (``Buffer.profile_roles()``), as one table.

A rank is ``node * V + i`` (V ranks a node). ``send_counts[s][d]``: rows rank s sends rank d (its
``layout.num_tokens_per_rank``); ``node_counts[s][m]``: tokens of rank s bound for node m, once a node however many
of its ranks hold them (``tokens_per_node``). Each role's bytes are those it writes:

- dispatch: an RDMA sender stages (and puts) a message a token a node, mine in place; a forwarder takes its rail
  peers' messages for its node (rail peer n, i of every node n, itself included) and writes a message a row for
  each rank of its node (its own rows straight into recv_x); an NVLink receiver stores the rows its node peers'
  forwarders send it;
- combine, backwards: an NVLink sender returns those rows to the node peer that forwarded them; a forwarder puts one
  partial sum a token it forwarded; a reader writes every token of this rank (out_x and its weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RoleBytes:
    """Messages (rows, tokens or partials) a role handles in one call on this rank, and the bytes it writes."""

    rows: int
    bytes: int


def role_bytes(operation: str, rank: int, num_nvl_ranks: int, send_counts: Sequence[Sequence[int]],
               node_counts: Sequence[Sequence[int]], message_bytes: int, num_tokens: int = 0,
               out_row_bytes: int = 0) -> dict[str, RoleBytes]:
    """Per role of ``operation``'s internode kernel (``dispatch``, ``dispatch-fp8``, ``combine``), what this rank's
    role moves: ``message_bytes`` a message (dispatch: a token's RDMA message; combine: a returned row or a partial
    sum, :func:`epjit.bench.normal.rdma_message_bytes`); a combine reader reads a partial a (token, node) pair and
    writes ``out_row_bytes`` for each of this rank's ``num_tokens``."""
    v = num_nvl_ranks
    node, i = divmod(rank, v)
    num_nodes = len(node_counts[0])
    node_ranks = range(node * v, node * v + v)
    rail = [n * v + i for n in range(num_nodes)]  # the rail peers whose streams my forwarder takes (me too)
    forwarded_rows = sum(send_counts[s][d] for s in rail for d in node_ranks)
    forwarded_tokens = sum(node_counts[s][node] for s in rail)
    # rows that reach me through a node peer's forwarder: from rank (n, j) of every node, j another rank of mine
    peer_rows = sum(send_counts[n * v + j][rank] for n in range(num_nodes) for j in range(v) if j != i)
    if operation == "combine":
        return {"nvl_sender": RoleBytes(peer_rows, peer_rows * message_bytes),
                "forwarder": RoleBytes(forwarded_tokens, forwarded_tokens * message_bytes),
                "reader": RoleBytes(sum(node_counts[rank]), num_tokens * out_row_bytes)}
    staged = sum(node_counts[rank])
    return {"rdma_sender": RoleBytes(staged, staged * message_bytes),
            "nvl_receiver": RoleBytes(peer_rows, peer_rows * message_bytes),
            "forwarder": RoleBytes(forwarded_rows, forwarded_rows * message_bytes)}


def role_table(summaries: Sequence[Any], moved: dict[str, RoleBytes]) -> list[str]:
    """Lines of one kernel's roles on one rank: ``summaries`` (epjit.ops.profile.RoleSummary, one kernel's) and what
    each role moved. Times in µs from the kernel's first start; active: a channel's done - start (median / largest);
    starved and blocked: a waiter's waits (median over the channels; - where the role has none); busy: what is left
    of active; GB/s: the role's bytes over its span (first start to last channel done)."""
    lines = [f"{'role':<13}{'ch':>3}{'start':>8}{'first':>8}{'last':>8}{'done':>8}{'active med/max':>16}"
             f"{'starved':>9}{'blocked':>9}{'busy':>8}{'rows':>8}{'MB':>8}{'GB/s':>7}"]
    for s in summaries:
        m = moved.get(s.role)
        rate = f"{m.bytes / (s.span * 1e-6) / 1e9:7.1f}" if m is not None and s.span > 0 else f"{'-':>7}"
        lines.append(f"{s.role:<13}{s.channels:>3}{s.start:8.1f}{s.first:8.1f}{s.last:8.1f}{s.done:8.1f}"
                     f"{f'{s.active:.1f}/{s.active_max:.1f}':>16}{_wait(s.starved)}{_wait(s.blocked)}"
                     f"{s.busy:8.1f}{m.rows if m else '-':>8}{f'{m.bytes / 1e6:.1f}' if m else '-':>8}{rate}")
    return lines


def _wait(us: float) -> str:
    return f"{'-':>9}" if us < 0 else f"{us:9.1f}"
