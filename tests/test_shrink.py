"""Shrink mode without a GPU: the reference's masked ranks (DeepEP's semantics), the argument checks of the mask
calls, the setting, and the host's reading of the kernels' reports."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from epjit.env import settings
from epjit.errors import ArgumentError, ArgumentTypeError
from epjit.front.low_latency import LowLatencyFront
from epjit.memory import WAIT_RECORD_DTYPE
from epjit.reference import low_latency as ref
from epjit.reference.results import BF16

R, E, M, H, K = 4, 16, 8, 256, 4


def _routing(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    xs, idx, w = [], [], []
    for r in range(R):
        n = 5 + r
        xs.append(rng.standard_normal((n, H)).astype(BF16))
        chosen = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int64)
        chosen[0, 1] = -1  # a slot without an expert
        idx.append(chosen)
        w.append(rng.random((n, K)).astype(np.float32))
    return xs, idx, w


def _owner_masked(idx: np.ndarray, masked: set[int]) -> np.ndarray:
    return (idx >= 0) & np.isin(idx // (E // R), sorted(masked))


@pytest.mark.parametrize("masked", [{1}, {0, 3}])
def test_nothing_arrives_from_a_masked_source(masked):
    xs, idx, _ = _routing()
    full = ref.low_latency_dispatch(xs, idx, M, E, use_fp8=False)
    shrunk = ref.low_latency_dispatch([None if r in masked else xs[r] for r in range(R)],
                                      [None if r in masked else idx[r] for r in range(R)], M, E, use_fp8=False,
                                      masked_ranks=masked)
    live = [s for s in range(R) if s not in masked]
    for r in range(R):
        if r in masked:
            assert shrunk[r] is None
            continue
        got, want = shrunk[r], full[r]
        for e in range(E // R):
            begin, count = ref.unpack_layout_range(got.handle.layout_range[e])
            w_begin, w_count = ref.unpack_layout_range(want.handle.layout_range[e])
            assert all(count[s] == 0 for s in masked)
            assert [count[s] for s in live] == [w_count[s] for s in live]
            assert got.recv_count[e] == sum(w_count[s] for s in live)
            for s in live:  # each live source's block holds what it held without the mask
                rows, w_rows = slice(begin[s], begin[s] + count[s]), slice(w_begin[s], w_begin[s] + w_count[s])
                assert np.array_equal(got.handle.src_info[e, rows], want.handle.src_info[e, w_rows])
                assert np.array_equal(got.x[e, rows].view(np.uint16), want.x[e, w_rows].view(np.uint16))


@pytest.mark.parametrize("masked", [{2}, {1, 3}])
def test_a_masked_owners_terms_come_back_as_zeros(masked):
    xs, idx, w = _routing(1)
    results = ref.low_latency_dispatch([None if r in masked else xs[r] for r in range(R)],
                                       [None if r in masked else idx[r] for r in range(R)], M, E, use_fp8=False,
                                       masked_ranks=masked)
    ys = [None if res is None else res.x for res in results]  # the experts answer with their input
    handles = [None if res is None else res.handle for res in results]
    combined = ref.low_latency_combine(ys, [None if r in masked else idx[r] for r in range(R)],
                                       [None if r in masked else w[r] for r in range(R)], handles,
                                       masked_ranks=masked)
    full = ref.low_latency_dispatch(xs, idx, M, E, use_fp8=False)
    # What the full routing combines when each term on a masked rank weighs 0 (adding 0 changes no bit).
    zeroed = [np.where(_owner_masked(idx[r], masked), 0, w[r]).astype(np.float32) for r in range(R)]
    want = ref.low_latency_combine([f.x for f in full], idx, zeroed, [f.handle for f in full])
    for r in range(R):
        if r in masked:
            assert combined[r] is None
        else:
            assert np.array_equal(combined[r].x.view(np.uint16), want[r].x.view(np.uint16))
            assert not np.array_equal(combined[r].x.view(np.uint16),
                                      ref.low_latency_combine([f.x for f in full], idx, w,
                                                              [f.handle for f in full])[r].x.view(np.uint16))


def test_the_reference_refuses_masks_that_are_not_ranks():
    xs, idx, _ = _routing()
    with pytest.raises(ArgumentError, match=r"masked_ranks has \[4\] but there are 4 ranks"):
        ref.low_latency_dispatch(xs, idx, M, E, use_fp8=False, masked_ranks=[4])
    with pytest.raises(ArgumentError, match="masks every one of the 4 ranks"):
        ref.low_latency_dispatch(xs, idx, M, E, use_fp8=False, masked_ranks=range(4))
    with pytest.raises(TypeError, match="masked_ranks"):
        ref.low_latency_dispatch(xs, idx, M, E, use_fp8=False, masked_ranks=5)


# ------------------------------------------------------------------------------------------------ the front


def _front(shrink: object) -> LowLatencyFront:
    """A low-latency front with nothing behind it but a recording ops stand-in."""
    front = object.__new__(LowLatencyFront)
    front.num_ranks, front.device = R, 0
    calls: list[tuple] = []
    if shrink is not None:
        shrink = SimpleNamespace(update=lambda rank, mask: calls.append(("update", rank, mask)),
                                 clean=lambda: calls.append(("clean",)), mask_reports=lambda: ["report"])
    front.ops = SimpleNamespace(shrink=shrink, calls=calls)
    return front


@pytest.mark.parametrize("call, args", [("update_mask", (1, True)), ("query_mask", (np.zeros(R, np.int32),)),
                                        ("clean_mask", ()), ("mask_reports", ())])
def test_mask_calls_without_shrink_mode_say_what_they_need(call, args):
    with pytest.raises(ArgumentError, match=r"needs a Buffer made with enable_shrink=True"):
        getattr(_front(None), call)(*args)


def test_update_mask_checks_the_rank_and_the_flag():
    front = _front(object())
    front.update_mask(3, True)
    front.update_mask(np.int64(0), False)
    assert front.ops.calls == [("update", 3, True), ("update", 0, False)]
    with pytest.raises(ArgumentError, match=r"rank_to_mask=4 is not a rank of this Buffer's 4"):
        front.update_mask(4, True)
    with pytest.raises(ArgumentError, match="rank_to_mask"):
        front.update_mask(-1, True)
    with pytest.raises(ArgumentTypeError, match="rank_to_mask"):
        front.update_mask(1.0, True)
    with pytest.raises(ArgumentTypeError, match="mask must be True or False"):
        front.update_mask(1, "yes")
    assert front.mask_reports() == ["report"]


@pytest.mark.parametrize("bad, error, words", [
    (np.zeros(R, np.int64), ArgumentTypeError, "mask_status"),
    (np.zeros(R + 1, np.int32), ArgumentError, "mask_status must have shape"),
    (np.zeros(R, np.int32), ArgumentTypeError, "mask_status"),  # host memory: not on this rank's GPU
])
def test_query_mask_checks_its_array(bad, error, words):
    with pytest.raises(error, match=words):
        _front(object()).query_mask(bad)


# ------------------------------------------------------------------------------------------------ host side


def test_the_shrink_timeout_is_a_setting(monkeypatch):
    monkeypatch.delenv("EPJIT_SHRINK_TIMEOUT_S", raising=False)
    assert settings().shrink_timeout_s is None  # the front then takes EPJIT_TIMEOUT_S
    monkeypatch.setenv("EPJIT_SHRINK_TIMEOUT_S", "2.5")
    assert settings().shrink_timeout_s == 2.5
    monkeypatch.setenv("EPJIT_SHRINK_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="EPJIT_SHRINK_TIMEOUT_S"):
        settings()


class _HostRecords:
    """Stands in for MappedHostArray: plain host memory a test writes as a kernel would."""

    def __init__(self, num_bytes: int) -> None:
        self.bytes = np.zeros(num_bytes, np.uint8)

    def parts(self, num_bytes: int) -> list:
        return [SimpleNamespace(bytes=self.bytes[o:o + num_bytes], ints=self.bytes[o:o + num_bytes].view(np.int32))
                for o in range(0, len(self.bytes), num_bytes)]


def test_a_masked_rank_is_a_warning_and_a_report_once(caplog):
    from epjit.ops.low_latency import STATUS_BIT_COUNT, STATUS_RANK_MASKED, LowLatency
    from epjit.ops.shrink import ShrinkMask

    shrink = object.__new__(ShrinkMask)
    shrink.records, shrink.reports, shrink.reported = _HostRecords(128 * R), [], set()
    rec = shrink.records.bytes[128 * 2:128 * 3].view(WAIT_RECORD_DTYPE)
    rec["rank"], rec["peer"], rec["channel"], rec["expected"], rec["observed"] = 0, 2, 5, 7, 6
    rec["elapsed_ns"], rec["site"], rec["status"] = 2_000_000_000, b"ll_combine: rows of expert", 1
    ops = object.__new__(LowLatency)
    ops.shrink, ops.num_experts, ops.num_max_tokens = shrink, E, M
    ops.host_status = SimpleNamespace(ints=np.zeros(16, np.int32))
    ops.status_seen = np.zeros(1 + STATUS_BIT_COUNT, np.int32)
    ops.host_status.ints[0], ops.host_status.ints[1 + STATUS_RANK_MASKED.bit_length() - 1] = 1, 1
    with caplog.at_level(logging.WARNING, logger="epjit.low_latency"):
        ops.raise_status()  # no error: a warning
        ops.raise_status()
    assert len(caplog.records) == 1 and "masked rank 2" in caplog.text and "ll_combine: rows of expert" in caplog.text
    assert [(r["peer"], r["channel"], r["expected"], r["observed"]) for r in shrink.reports] == [(2, 5, 7, 6)]
    ops.host_status.ints[0], ops.host_status.ints[1] = 2, 1  # an invalid id beside it is still an error
    with pytest.raises(ArgumentError, match="topk_idx had entries outside"):
        ops.raise_status()
