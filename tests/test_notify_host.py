"""What the host makes of notify's words (no GPU): the rows it allocates before the counts are known, and the
errors it raises from the status, meta and totals notify publishes (epjit.ops.notify's record layout), and
from the low-latency kernels' status words."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from epjit import ArgumentError, Buffer
from epjit.front.common import Absent
from epjit.front.low_latency import LowLatencyFront
from epjit.front.normal import IntranodeFront
from epjit.kernels.intranode import META_INTS
from epjit.ops import low_latency as ll_ops
from epjit.ops import notify as ops
from epjit.ops.intranode import Intranode
from epjit.ops.normal import DispatchHandle


def _estimate(ranks: int, rates: list[float], num_tokens: int, rows: list[int] | None = None) -> int:
    estimate = ops.RowEstimate(ranks)
    estimate.rates.extend(rates)
    estimate.recent_rows.extend(rows if rows is not None else [1 << 30] * len(rates))  # no bound unless given
    return estimate.rows(num_tokens)


def test_first_estimate_is_every_token_to_every_rank_then_the_largest_recent_rate_with_slack():
    assert _estimate(4, [], 4096) == 4 * 4096
    assert _estimate(4, [], 0) == 0
    # 3.6 rows a token at most lately (layers differ): 3.6 x 4096 x 17/16 + 128
    assert _estimate(4, [3.1, 3.6, 2.9], 4096) == int(3.6 * 4096 * 17 / 16) + 128
    assert _estimate(8, [5.3], 0) == 128  # an empty rank still has room for a few rows
    # Only the last RATE_HISTORY calls count: an early outlier ages out.
    assert _estimate(4, [3.9] + [3.0] * ops.RATE_HISTORY, 1000) == int(3.0 * 1000 * 17 / 16) + 128
    estimate = ops.RowEstimate(2)
    estimate.saw(0, 10)  # an empty call says nothing about the rate, but its rows bound the next estimate
    estimate.saw(100, 150)
    assert list(estimate.rates) == [1.5] and list(estimate.recent_rows) == [10, 150]


def test_estimate_is_at_most_twice_the_most_rows_lately():
    # A rank that sent 1 token and received 1,200 rows (rate 1,200), then sends 512: the rate alone would take
    # 650k rows; the rows it received lately bound it.
    estimate = ops.RowEstimate(8)
    estimate.saw(300, 900)
    estimate.saw(1, 1200)
    assert estimate.rows(512) == 2 * 1200 + 128
    assert estimate.rows(100) == min(int(1200 * 100 * 17 / 16) + 128, 2 * 1200 + 128)
    # A rank that received nothing lately still gets the 128 spare rows; the rate term wins when it is smaller.
    assert _estimate(4, [0.0], 4096, rows=[0]) == 128
    assert _estimate(4, [0.5], 100, rows=[5000]) == int(0.5 * 100 * 17 / 16) + 128


def _host_out(status: int, metas: list[list[int]], totals: list[int]) -> np.ndarray:
    r = len(metas)
    ints = np.zeros(2 + (META_INTS + 1) * r + 4, dtype=np.int32)
    ints[0], ints[1] = totals[0], status
    for i, m in enumerate(metas):
        ints[2 + i * META_INTS:2 + i * META_INTS + len(m)] = m
    ints[2 + META_INTS * r:2 + (META_INTS + 1) * r] = totals
    return ints


def _check(ints: np.ndarray, num_worst_tokens: int = 0) -> str:
    error = ops.refusal(ints, 2, 1 << 20, num_worst_tokens)
    assert isinstance(error, ArgumentError)
    return str(error)


def test_worst_tokens_too_small_names_the_ranks_that_overflow():
    worst = ops.FLAG_WORST_TOKENS
    host = _host_out(ops.STATUS_WORST_TOO_SMALL, [[7168, 64, 8, worst, 100], [7168, 64, 8, worst, 100]], [90, 130])
    msg = _check(host, 100)
    assert "num_worst_tokens=100 is too small" in msg and "rank 1: 130 for 100" in msg and "rank 0" not in msg


def test_differing_meta_is_named_but_own_bits_are_not():
    # rank 1 used num_worst_tokens (an own bit) and another hidden size: only hidden is reported.
    host = _host_out(ops.STATUS_META_MISMATCH, [[7168, 64, 8, 0, 10], [4096, 64, 8, ops.FLAG_WORST_TOKENS, 10]],
                     [5, 5])
    msg = _check(host)
    assert "hidden differs across ranks: rank 0: 7168, rank 1: 4096" in msg and "flags" not in msg


def test_sizes_that_differ_only_in_an_own_bit_still_differ():
    # 2048 and 2056 differ in bit 3, which is an own bit of the flags word (num_worst_tokens), not of hidden.
    host = _host_out(ops.STATUS_META_MISMATCH, [[2048, 64, 8, 0, 10], [2056, 64, 8, 0, 10]], [5, 5])
    assert "hidden differs across ranks: rank 0: 2048, rank 1: 2056" in _check(host)


def test_over_capacity_with_a_handle_says_the_routing_changed():
    host = _host_out(ops.STATUS_OVER_CAPACITY, [[7168, 64, 8, 0, 40], [7168, 64, 8, 0, 40]], [40, 41])
    msg = _check(host)
    assert "does not match the handle's" in msg and "rank 1: 41 for 40" in msg


def test_nothing_to_say_when_the_status_is_clear():
    host = _host_out(0, [[7168, 64, 8, 0, 10], [7168, 64, 8, 0, 10]], [5, 5])
    assert ops.refusal(host, 2, 1, 0) is None


class _FakeRecord:
    """MappedHostArray without a GPU: notify's words, and whether the Buffer freed it."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self.ints = np.zeros(num_bytes // 4, dtype=np.int32)
        self.closed = False
        self.device_ptr = 0

    def parts(self, num_bytes: int) -> list[_FakeRecord]:
        return [_FakeRecord(num_bytes) for _ in range(self.num_bytes // num_bytes)]

    def close(self) -> None:
        self.closed = True


class _FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def synchronize(self) -> None:
        self.waited = self.done = True


def _records(monkeypatch: pytest.MonkeyPatch, rank: int = 0) -> ops.HostRecords:
    monkeypatch.setattr(ops, "MappedHostArray", _FakeRecord)
    return ops.HostRecords(rank, 2, 1 << 20, 64, raise_for=lambda e: None)


def _worst_call(records: ops.HostRecords, status: int = 0) -> tuple[_FakeRecord, _FakeEvent]:
    """A worst-token dispatch as dispatch() books it: a record, then a pending entry; notify's status written."""
    record, call = records.take(64, captured=False)
    record.ints[:] = 0
    record.ints[1] = status
    if status:  # both ranks asked for 8 rows and would receive 30
        for i in range(2):
            record.ints[2 + i * META_INTS + 3] = ops.FLAG_WORST_TOKENS
            record.ints[2 + i * META_INTS + 4] = 8
        record.ints[2 + META_INTS * 2:2 + META_INTS * 2 + 2] = 30
    event = _FakeEvent()
    records.add_pending(call, event, record, 8)
    return record, event


def _not_capturing() -> bool:
    return False


def test_a_refusal_the_host_ran_past_is_raised_later_not_overwritten(monkeypatch):
    records = _records(monkeypatch)
    refused, refused_event = _worst_call(records, ops.STATUS_WORST_TOO_SMALL)
    fine, fine_event = _worst_call(records)
    assert fine is not refused  # each call has its own record: the second cannot overwrite the first's status
    records.check(_not_capturing)  # neither event done: nothing to say yet, nothing waited for
    assert len(records.pending) == 2 and not refused_event.waited
    refused_event.done = fine_event.done = True
    records.check(lambda: True)  # not while the caller captures a graph
    assert len(records.pending) == 2
    with pytest.raises(ArgumentError, match="num_worst_tokens=8 is too small for what arrives"):
        records.check(_not_capturing)
    records.check(_not_capturing)  # reported once; the later call had nothing to report
    assert not records.pending


def test_a_record_comes_round_only_after_its_last_call_is_reported(monkeypatch):
    records = _records(monkeypatch)
    first, first_event = _worst_call(records, ops.STATUS_WORST_TOO_SMALL)
    for _ in range(ops.HOST_RECORDS - 1):
        _worst_call(records)
    assert len({id(r) for r in records.records}) == ops.HOST_RECORDS
    # The next call needs the first record again: the host waits for the first call and raises its refusal before
    # any of the new call's kernels could be launched.
    with pytest.raises(ArgumentError, match="too small for what arrives"):
        records.take(64, captured=False)
    assert first_event.waited and len(records.pending) == ops.HOST_RECORDS - 1
    record, call = records.take(64, captured=False)  # the next record's last call had nothing to report
    assert call == ops.HOST_RECORDS + 1 and record is records.records[1]
    assert len(records.pending) == ops.HOST_RECORDS - 2
    # More experts than a record holds: a larger one replaces it, the old one is freed.
    old = records.records[2]
    bigger, _ = records.take(1 << 16, captured=False)
    assert bigger.num_bytes > 4096 and records.records[2] is bigger and old.closed
    # A captured dispatch always takes the graph's record, which the host never waits for.
    assert records.take(64, captured=True) == (records.graph, -1)
    with pytest.raises(ArgumentError, match="captured in a CUDA graph takes up to 4096 experts"):
        records.take(1 << 20, captured=True)


def test_a_refused_graph_replay_is_raised_by_the_next_look_once(monkeypatch):
    records = _records(monkeypatch, rank=1)
    record = records.graph
    records.check(_not_capturing)  # notify never wrote the graph's record: nothing to say
    # What notify writes when it refuses a replay (kFlagCaptured): rank 1 asked for 8 rows and would receive 30.
    record.ints[1] = ops.STATUS_WORST_TOO_SMALL
    for i, capacity in enumerate((100, 8)):
        record.ints[2 + i * META_INTS + 3] = ops.FLAG_WORST_TOKENS | ops.FLAG_CAPTURED
        record.ints[2 + i * META_INTS + 4] = capacity
    record.ints[2 + META_INTS * 2:2 + META_INTS * 2 + 2] = (20, 30)
    with pytest.raises(ArgumentError, match=r"replayed from a CUDA graph was refused on every rank: "
                                            r"num_worst_tokens=8 is too small .*rank 1: 30 for 8\)"):
        records.check(_not_capturing)
    records.check(_not_capturing)  # read once: the record's status was cleared


def _closable_with_refusal(monkeypatch: pytest.MonkeyPatch) -> tuple[Buffer, list[str], ops.HostRecords]:
    records = _records(monkeypatch)
    released: list[str] = []
    intranode = object.__new__(Intranode)  # only the host-record state: no group, no GPU
    intranode.records = records
    normal = object.__new__(IntranodeFront)
    normal.ops = intranode
    buf = object.__new__(Buffer)
    buf._closed, buf._low_latency, buf._normal, buf.comm_stream = False, Absent("no low latency"), normal, None
    buf.mem = SimpleNamespace(synchronize=lambda stream: None, close=lambda: released.append("peer memory"))
    monkeypatch.setattr(IntranodeFront, "_caller_capturing", lambda self: False)
    _, event = _worst_call(records, ops.STATUS_WORST_TOO_SMALL)
    event.done = True
    return buf, released, records


def test_close_raises_an_unreported_refusal_after_releasing_everything(monkeypatch):
    buf, released, records = _closable_with_refusal(monkeypatch)
    with pytest.raises(ArgumentError, match="too small for what arrives"):
        buf.close()
    assert released == ["peer memory"] and records.records[0].closed and records.pool.closed
    buf.close()  # closed once: nothing more to raise


def test_leaving_a_with_block_on_an_exception_keeps_that_exception(monkeypatch):
    buf, released, _ = _closable_with_refusal(monkeypatch)
    with pytest.raises(KeyError), buf:
        raise KeyError("the caller's own error")
    assert released == ["peer memory"]


def test_synchronize_and_close_raise_what_a_low_latency_kernel_found_once(monkeypatch):
    buf, released, records = _closable_with_refusal(monkeypatch)
    records.pending.clear()
    status = np.zeros(16, dtype=np.int32)
    ll = object.__new__(ll_ops.LowLatency)  # only the status words: no GPU
    ll.num_experts, ll.num_max_tokens, ll.closed = 64, 8, False
    ll.host_status = SimpleNamespace(ints=status, close=lambda: released.append("ll"))
    ll.status_seen = np.zeros(1 + ll_ops.STATUS_BIT_COUNT, dtype=np.int32)
    low_latency = object.__new__(LowLatencyFront)
    low_latency.ops = ll
    buf._low_latency = low_latency

    def publish(bits: int) -> None:  # what a low-latency call's last block does (publish_status)
        for i in range(ll_ops.STATUS_BIT_COUNT):
            status[1 + i] += bits >> i & 1
        status[0] += 1

    publish(ll_ops.STATUS_INVALID_IDS)
    with pytest.raises(ArgumentError, match=r"earlier low-latency call was wrong.*outside \[-1, num_experts=64\)"):
        buf.synchronize()
    buf.synchronize()  # once
    assert status[0] == 1 and status[1] == 1  # the host never writes the kernels' words
    publish(ll_ops.STATUS_INVALID_IDS)  # the same problem again is raised again, and alone
    with pytest.raises(ArgumentError,
                       match=r"valid: topk_idx had entries outside \[-1, num_experts=64\) \(skipped\)$"):
        buf.synchronize()
    publish(ll_ops.STATUS_SLOT_OVERFLOW)
    publish(ll_ops.STATUS_META_MISMATCH | ll_ops.STATUS_SLOT_OVERFLOW)  # two reports between checks: both at once
    with pytest.raises(ArgumentError, match="num_max_dispatch_tokens_per_rank=8 slots.*another hidden size") as e:
        buf.close()
    assert "outside" not in str(e.value)
    assert released == ["ll", "peer memory"] and ll.closed


def test_pooled_records_share_one_allocation_and_close_with_it():
    from epjit.memory import MappedHostArray

    whole = object.__new__(MappedHostArray)  # cudaHostAlloc's part done by hand: 3.5 records of 4 KB
    whole.num_bytes, whole._host, whole.device_ptr = 14336, 0, 1 << 40
    whole.bytes = np.zeros(whole.num_bytes, dtype=np.uint8)
    parts = whole.parts(4096)
    assert [p.device_ptr - whole.device_ptr for p in parts] == [0, 4096, 8192]  # no part past the end
    parts[1].ints[0] = 7  # notify writing the second record is seen in the allocation, and only there
    assert whole.bytes[4096:4100].view(np.int32)[0] == 7 and parts[0].ints[0] == parts[2].ints[0] == 0
    parts[1].close()  # a part frees nothing (the Buffer closes the whole last)
    assert parts[1].ints[0] == 7 and parts[1].num_bytes == 4096


def test_a_dispatch_handle_names_its_arrays_and_sizes():
    """A handle keeps its six int arrays as one tuple and its sizes through its plan; each name reaches its own."""

    class _Part:
        def __init__(self, n: int) -> None:
            self.n = n

        def view(self, rows: int | None = None) -> tuple[int, int | None]:
            return self.n, rows

    plan = SimpleNamespace(num_tokens=1, hidden=2, num_topk=3, num_channels=4, num_experts=5)
    handle = DispatchHandle(tuple(_Part(i) for i in range(6)), 0, None, 7, 8, plan, 9)
    assert (handle.num_tokens, handle.hidden, handle.num_topk, handle.num_channels, handle.num_experts) == (1, 2, 3,
                                                                                                           4, 5)
    names = ("rank_prefix_ints", "channel_prefix_ints", "recv_channel_offset_ints", "send_head_ints",
             "recv_src_ints", "status_ints")
    assert [getattr(handle, name).n for name in names] == list(range(6))
    views = (handle.rank_prefix_matrix, handle.channel_prefix_matrix, handle.recv_channel_offset, handle.send_head)
    assert views == ((0, None), (1, None), (2, None), (3, None)) and handle.recv_src_idx == (4, 8)  # rows received


def test_a_replay_whose_handle_knows_its_rows_waits_for_no_record():
    """A handle replay whose rows the handle knows returns without reading notify's record (its refusal is raised by
    a later call, as a worst-token dispatch's); one whose rows never reached the host (a worst-token dispatch's
    handle) and any internode replay wait for it; a dispatch without a handle always does."""
    from epjit.ops.internode import Internode

    plan = SimpleNamespace(num_tokens=1, hidden=2, num_topk=3, num_channels=4, num_experts=5)
    known = DispatchHandle((), 0, None, 77, 77, plan)
    unknown = DispatchHandle((), 0, None, -1, 128, plan)
    assert Intranode._replay_record(known) == [77]
    assert Intranode._replay_record(unknown) is None
    assert Intranode._replay_record(None) is None
    assert Internode._replay_record(known) is None
