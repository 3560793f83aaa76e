"""Notify's host records, which both normal-mode families share (cuda_src/status.cuh): the status bits and flags of
the protocol, the refusal a record decodes to, the pool of records and the worst-token calls not yet reported, and
the estimate that sizes outputs before the counts are known.

A notify host record (mapped host memory, int32; docs/layouts.md; across nodes epjit.ops.internode's adds the
tokens every rank forwards after the rows):

    [0] rows this rank receives (-1 until notify writes it, last, with a system-scope release)
    [1] status bits (0: accepted)
    [2 .. 2 + 8R)  every rank's meta: hidden, num_experts, num_topk, flags, recv_capacity, 0, 0, 0
    [.. + R)       rows each rank receives
    [.. + E/R)     tokens received per local expert (rounded up to expert_alignment)
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..errors import ArgumentError, with_rank
from ..kernels.intranode import META_INTS
from ..memory import MappedHostArray

# Status bits of notify (kStatus* in cuda_src/status.cuh): why every rank refused a call.
STATUS_META_MISMATCH, STATUS_WORST_TOO_SMALL, STATUS_LAYOUT_TOO_BIG, STATUS_INVALID_IDS = 1, 2, 4, 8
STATUS_OVER_CAPACITY = 16  # some rank's rows do not fit the outputs allocated for them
# Flags each rank announces in its meta (kFlag*), and meta bits a rank sets about itself (kMeta*).
FLAG_FP8, FLAG_WEIGHTS, FLAG_TOPK, FLAG_WORST_TOKENS, FLAG_CAPTURED = 1, 2, 4, 8, 16
META_INVALID_IDS, META_LAYOUT_TOO_BIG = 1 << 29, 1 << 30
OWN_META_BITS = META_INVALID_IDS | META_LAYOUT_TOO_BIG | FLAG_WORST_TOKENS | FLAG_CAPTURED  # need not agree
META_NAMES = ("hidden", "num_experts", "num_topk", "flags")  # the meta every rank must agree on, in order
# Host records a dispatch after dispatch may leave in flight: each call gets its own, round robin, because a
# worst-token dispatch does not wait for its record (it is read once the call's event is done) and the host runs
# ahead of the GPU. A record comes round again only after the call that last wrote it has been reported, so a
# later call can neither overwrite an unreported refusal nor take an earlier call's counts for its own; a host this
# many calls ahead waits for the oldest.
HOST_RECORDS = 64
HOST_RECORD_BYTES = 4096  # a record's least size and its share of the pool (more experts: a record of its own)
RATE_HISTORY = 32  # dispatches whose received rows per token size the next one's outputs (RowEstimate)


def expert_counts_at(num_ranks: int, forwarded: bool = False) -> int:
    """Where the host record's rows per local expert start: after [0] rows, [1] status, the metas and the totals
    (and, across nodes, the tokens each rank forwards)."""
    return 2 + (META_INTS + (2 if forwarded else 1)) * num_ranks


def host_record_bytes(num_ranks: int, num_experts: int, forwarded: bool = False) -> int:
    return max(4 * (expert_counts_at(num_ranks, forwarded) + num_experts // num_ranks), HOST_RECORD_BYTES)


def call_flags(fp8: bool, with_weights: bool, with_idx: bool, num_worst_tokens: int) -> int:
    """The flags a rank announces in its meta for a dispatch of this kind (kFlag*)."""
    return (FLAG_FP8 if fp8 else 0) | (FLAG_WEIGHTS if with_weights else 0) | (FLAG_TOPK if with_idx else 0) | \
        (FLAG_WORST_TOKENS if num_worst_tokens > 0 else 0)


def describe_meta(name: str, value: int) -> str:
    if name != "flags":
        return str(value)
    return "/".join([("FP8" if value & FLAG_FP8 else "bf16"), ("weights" if value & FLAG_WEIGHTS else "no weights"),
                     ("topk_idx" if value & FLAG_TOPK else "no topk_idx")])


def refusal(ints: np.ndarray, num_ranks: int, num_nvl_bytes: int, num_worst_tokens: int,
            replayed: bool = False, forwarded: bool = False) -> ArgumentError | None:
    """What a notify record says was refused, as the error to raise (None when its status is 0). ``forwarded``: an
    internode record, whose metas also carry the forwarded-token capacity and a config tag, and whose totals are
    followed by the tokens each rank forwards."""
    status = int(ints[1])
    if status == 0:
        return None
    r = num_ranks
    meta = ints[2:2 + META_INTS * r].reshape(r, META_INTS).copy()
    totals = ints[2 + META_INTS * r:2 + (META_INTS + 1) * r].copy()
    problems = []
    if status & STATUS_LAYOUT_TOO_BIG:
        buffers = "num_nvl_bytes / num_rdma_bytes" if forwarded else f"num_nvl_bytes={num_nvl_bytes}"
        problems.append(f"the call's rings do not fit {buffers} on some rank (a larger Buffer or a smaller Config: "
                        "chunk sizes / num_sms)")
    if status & STATUS_INVALID_IDS:
        ranks = [i for i in range(r) if meta[i, 3] & META_INVALID_IDS]
        problems.append(f"topk_idx has entries outside [-1, num_experts={int(meta[ranks[0], 1])}) on rank(s) "
                        f"{', '.join(map(str, ranks))}")
    if status & STATUS_META_MISMATCH:
        compared = list(enumerate(META_NAMES)) + ([(7, "config")] if forwarded else [])
        for j, name in compared:
            column = meta[:, j] & ~OWN_META_BITS if name == "flags" else meta[:, j]
            if len(set(column.tolist())) > 1:
                values = ", ".join(f"rank {i}: {describe_meta(name, int(v))}" for i, v in enumerate(column))
                problems.append(f"{name} differs across ranks: {values}")
    capacities = [("rows received", totals, 4)]
    if forwarded:
        capacities.append(("tokens forwarded", ints[2 + (META_INTS + 1) * r:2 + (META_INTS + 2) * r].copy(), 5))
    if status & STATUS_WORST_TOO_SMALL:
        for what, counts, column in capacities:
            values = ", ".join(f"rank {i}: {int(v)} for {int(meta[i, column])}" for i, v in enumerate(counts)
                               if meta[i, 3] & FLAG_WORST_TOKENS and v > meta[i, column])
            if values:
                problems.append(f"num_worst_tokens={num_worst_tokens} is too small for what arrives ({what} for "
                                f"num_worst_tokens: {values})")
    if status & STATUS_OVER_CAPACITY and not problems:
        values = "; ".join(f"{what}: " + ", ".join(f"rank {i}: {int(v)} for {int(meta[i, column])}"
                                                   for i, v in enumerate(counts) if meta[i, column] < v)
                           for what, counts, column in capacities if (meta[:, column] < counts).any())
        problems.append(f"the routing does not match the handle's ({values})")
    what = "a dispatch replayed from a CUDA graph was" if replayed else "dispatch"
    return ArgumentError(with_rank(f"{what} refused on every rank: " + "; ".join(problems)))


class _Pending(NamedTuple):
    call: int
    event: Any  # a cupy.cuda.Event recorded on the communication stream after the call
    record: MappedHostArray
    num_worst_tokens: int


class HostRecords:
    """The mapped host records notify fills: a pool of HOST_RECORDS taken round robin, the record of every dispatch
    captured in a CUDA graph (replays write it whenever they run; the host reads it only when its status is set),
    and the worst-token calls whose record is not read yet, oldest first."""

    def __init__(self, rank: int, num_ranks: int, num_nvl_bytes: int, graph_experts: int,
                 raise_for: Callable[[BaseException], None], forwarded: bool = False) -> None:
        self.rank, self.num_ranks, self.num_nvl_bytes = rank, num_ranks, num_nvl_bytes
        self.forwarded = forwarded  # internode records (refusal's forwarded)
        self.raise_for = raise_for  # turns a CUDA error met while waiting into the error to raise
        self.records: list[MappedHostArray | None] = [None] * HOST_RECORDS
        self.calls = [-1] * HOST_RECORDS  # the dispatch (numbered from 0) that last used each record
        self.num_calls = 0
        self.pending: collections.deque[_Pending] = collections.deque()
        self.pool: MappedHostArray | None = None
        # Made now: pinned memory cannot be allocated during a capture. One cudaHostAlloc for the pool.
        self.graph = MappedHostArray(host_record_bytes(num_ranks, max(graph_experts, 4096), forwarded))
        try:
            self.pool = MappedHostArray(HOST_RECORDS * HOST_RECORD_BYTES)
        except BaseException:
            self.graph.close()
            raise
        self.records[:] = self.pool.parts(HOST_RECORD_BYTES)

    def take(self, num_experts: int, captured: bool) -> tuple[MappedHostArray, int]:
        """The record notify fills for this dispatch, and the call's number (-1 for a captured one)."""
        need = host_record_bytes(self.num_ranks, num_experts, self.forwarded)
        if captured:
            if need > self.graph.num_bytes:
                raise ArgumentError(with_rank(f"a dispatch captured in a CUDA graph takes up to 4096 experts (or the "
                                              f"Buffer's num_experts), got {num_experts}"))
            return self.graph, -1
        call, i = self.num_calls, self.num_calls % HOST_RECORDS
        self.num_calls += 1
        while self.pending and self.pending[0].call <= self.calls[i]:
            self.report_oldest()  # the record's last writer first (waiting for it, if the host ran this far ahead)
        self.calls[i] = call
        record = self.records[i]
        if record is None or record.num_bytes < need:
            if record is not None:
                record.close()  # its call is over: it waited for its counts, or was just reported
            record = self.records[i] = MappedHostArray(need)
        return record, call

    def add_pending(self, call: int, event: Any, record: MappedHostArray, num_worst_tokens: int) -> None:
        self.pending.append(_Pending(call, event, record, num_worst_tokens))

    def check(self, capturing: Callable[[], bool]) -> None:
        """Raise what earlier worst-token dispatches' notify found, oldest first, for those their stream got past,
        and what a replayed graph's notify refused since the last look (not while the caller captures a graph)."""
        graph = self.graph
        graph_refused = graph.ints[1] != 0
        if not (self.pending or graph_refused) or capturing():  # the common case asks the stream nothing
            return
        while self.pending and self.pending[0].event.done:
            self.report_oldest()
        if graph_refused:
            seen = graph.ints.copy()
            graph.ints[1] = 0
            me = self.rank % self.num_ranks
            error = refusal(seen, self.num_ranks, self.num_nvl_bytes, int(seen[2 + META_INTS * me + 4]), True,
                            self.forwarded)
            if error is not None:
                raise error

    def report_oldest(self) -> None:
        """Wait for the oldest unreported worst-token dispatch and raise what its notify found (once)."""
        pending = self.pending.popleft()
        try:
            pending.event.synchronize()
        except Exception as e:
            if type(e).__name__ == "CUDARuntimeError":  # a kernel trapped (a timed-out wait): say what it waited for
                self.raise_for(e)
            raise
        error = refusal(pending.record.ints, self.num_ranks, self.num_nvl_bytes, pending.num_worst_tokens,
                        forwarded=self.forwarded)
        if error is not None:
            raise error

    def close(self) -> None:
        for record in (*self.records, self.graph, self.pool):
            if record is not None:
                record.close()  # a pooled record's does nothing; the pool's, last, frees them all


class RowEstimate:
    """Rows of dispatch output to allocate before the counts are known: R x N the first time (every token to every
    rank; more arrive only when other ranks send more tokens than this one), then the most rows per token of the
    last RATE_HISTORY calls, times N, plus 1/16 and 128 rows. The most, not the last: one Buffer serves every MoE
    layer of a model, each with its own routing balance, and a call that does not fit costs a second notify (notify
    stops it on every rank and it runs again with the exact rows).

    At most twice the most rows of those calls, plus 128: what a rank receives is what the others send, so a call
    in which this rank sent 1 token and received 1,000 rows (a rate of 1,000) says nothing about a call of 512
    tokens, for which the rate alone would allocate half a million rows (gigabytes at hidden 4096). A call that
    outgrows the bound twofold (a prefill after decode steps) runs twice once, and is part of the bound after."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.rates: collections.deque[float] = collections.deque(maxlen=RATE_HISTORY)
        self.recent_rows: collections.deque[int] = collections.deque(maxlen=RATE_HISTORY)
        self.retries = 0  # dispatches run again because their outputs were too small (tests read it)

    def rows(self, num_tokens: int) -> int:
        if not self.recent_rows:
            return self.num_ranks * num_tokens
        by_rate = int(max(self.rates, default=0.0) * num_tokens * 17 / 16) + 128
        return min(by_rate, 2 * max(self.recent_rows) + 128)

    def saw(self, num_tokens: int, num_rows: int) -> None:
        self.recent_rows.append(num_rows)
        if num_tokens > 0:
            self.rates.append(num_rows / num_tokens)
