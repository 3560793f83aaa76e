"""Shrink mode of normal mode inside one node, without a GPU: the reference's masked ranks, the kernels' shrink
builds and their header words, and the argument checks of the mask calls and of replays."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from epjit.errors import ArgumentError
from epjit.front.normal import IntranodeFront
from epjit.kernels import check_specs
from epjit.kernels.intranode import (
    NORMAL_SHRINK_BYTES,
    NORMAL_SHRINK_MASK_AT,
    NORMAL_SHRINK_OFFSET,
    IntranodeCombineFp8ShrinkSpec,
    IntranodeNotifyShrinkSpec,
    IntranodeNotifySpec,
    IntranodeShrinkSpec,
    combine_fp8_spec,
    intranode_spec,
    shrink_spec,
)
from epjit.reference import normal as ref
from epjit.reference.results import BF16

R, E, H, K = 4, 16, 256, 4
CUDA = Path(__file__).resolve().parents[1] / "cuda_src"


def _routing(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    xs, idx, w = [], [], []
    for r in range(R):
        n = 6 + r
        xs.append(rng.standard_normal((n, H)).astype(BF16))
        idx.append(np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int64))
        w.append(rng.random((n, K)).astype(np.float32))
    return xs, idx, w


@pytest.mark.parametrize("masked", [{1}, {0, 3}])
def test_nothing_arrives_from_a_masked_source(masked):
    """A masked source is a source without tokens; a masked rank's own result is None."""
    xs, idx, w = _routing()
    got = ref.dispatch(xs, idx, w, E, masked_ranks=masked)
    cut = [x[:0] if r in masked else x for r, x in enumerate(xs)]
    cut_idx = [i[:0] if r in masked else i for r, i in enumerate(idx)]
    cut_w = [v[:0] if r in masked else v for r, v in enumerate(w)]
    want = ref.dispatch(cut, cut_idx, cut_w, E)
    for r in range(R):
        if r in masked:
            assert got[r] is None
            continue
        np.testing.assert_array_equal(got[r].x, want[r].x)
        np.testing.assert_array_equal(got[r].topk_idx, want[r].topk_idx)
        assert got[r].num_recv_tokens_per_expert == want[r].num_recv_tokens_per_expert
        np.testing.assert_array_equal(got[r].handle.rank_prefix_matrix[:, r], want[r].handle.rank_prefix_matrix[:, r])


@pytest.mark.parametrize("use_fp8", [False, True])
def test_a_masked_ranks_terms_come_back_as_zeros(use_fp8):
    """A rank masked after the dispatch (it left before its combine): its rows count as zeros; None for it."""
    xs, idx, w = _routing(1)
    d = ref.dispatch(xs, idx, w, E)
    ys = [r_.x for r_ in d]
    zeroed = [np.zeros_like(y) if r == 2 else y for r, y in enumerate(ys)]
    got = ref.combine([None if r == 2 else y for r, y in enumerate(ys)], [r_.handle for r_ in d],
                      use_fp8=use_fp8, masked_ranks={2})
    want = ref.combine(zeroed, [r_.handle for r_ in d], use_fp8=use_fp8)
    assert got[2] is None
    for r in (0, 1, 3):
        np.testing.assert_array_equal(got[r].x, want[r].x)


def test_the_reference_refuses_masking_every_rank_and_nodes():
    xs, idx, w = _routing()
    with pytest.raises(ArgumentError, match="masks every one"):
        ref.dispatch(xs, idx, w, E, masked_ranks=range(R))
    d = ref.dispatch(xs, idx, w, E)
    with pytest.raises(ArgumentError, match="one NVLink node"):
        ref.combine([r_.x for r_ in d], [r_.handle for r_ in d], num_nvl_ranks=2, masked_ranks={1})


def test_shrink_builds_are_the_same_kernels_with_the_define():
    for spec in (IntranodeNotifySpec(4), intranode_spec(4), combine_fp8_spec(intranode_spec(4))):
        built = shrink_spec(spec)
        assert built.DEFINES == ("EPJIT_NORMAL_SHRINK",) and built.KERNELS == spec.KERNELS
        assert dataclasses.astuple(built) == dataclasses.astuple(spec)
        assert shrink_spec(built) is built
    assert isinstance(combine_fp8_spec(shrink_spec(intranode_spec(2))), IntranodeCombineFp8ShrinkSpec)
    checked = {type(s) for s in check_specs()}
    assert {IntranodeNotifyShrinkSpec, IntranodeShrinkSpec, IntranodeCombineFp8ShrinkSpec} <= checked


def test_the_header_words_match_the_device_struct():
    header = (CUDA / "intranode.cuh").read_text()
    assert f"kNvlShrinkOffset = {NORMAL_SHRINK_OFFSET}" in header
    assert f"sizeof(NormalShrink) == {NORMAL_SHRINK_BYTES}" in header
    fields = re.search(r"struct NormalShrink \{(.*?)\};", header, re.S).group(1)
    assert [line.split()[0] for line in fields.strip().splitlines()] == ["WaitRecord*", "uint64_t", "int32_t"]
    assert NORMAL_SHRINK_MASK_AT == 16 and 32 <= NORMAL_SHRINK_OFFSET and NORMAL_SHRINK_OFFSET + 48 <= 4096


def _front(shrink: object, rank: int = 0) -> IntranodeFront:
    front = object.__new__(IntranodeFront)
    front.num_ranks, front.device, front.shrink = R, 0, shrink is not None
    calls: list[tuple] = []
    if shrink is not None:
        shrink = SimpleNamespace(update=lambda r, m: calls.append(("update", r, m)), mask_reports=lambda: ["x"])
    front.ops = SimpleNamespace(shrink=shrink, calls=calls)
    front.res = SimpleNamespace(group=SimpleNamespace(rank=rank))
    return front


@pytest.mark.parametrize("call, args", [("update_mask", (1, True)), ("query_mask", (np.zeros(R, np.int32),)),
                                        ("clean_mask", ()), ("mask_reports", ())])
def test_mask_calls_without_shrink_mode_say_what_they_need(call, args):
    with pytest.raises(ArgumentError, match=rf"^{call} needs a Buffer made with enable_shrink=True"):
        getattr(_front(None), call)(*args)


def test_update_mask_checks_the_rank():
    front = _front(object(), rank=2)
    front.update_mask(3, True)
    assert front.ops.calls == [("update", 3, True)] and front.mask_reports() == ["x"]
    with pytest.raises(ArgumentError, match="rank_to_mask=4 is not a rank"):
        front.update_mask(4, True)
    with pytest.raises(ArgumentError, match="rank_to_mask=2 is this rank"):
        front.update_mask(2, True)
