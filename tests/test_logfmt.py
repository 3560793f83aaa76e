"""The reference's LogFMT-10 combine (DeepEP's low-precision low-latency combine): the round trip's format rules, its
error against the bf16 combine within DeepEP's bound on DeepEP's test data, and its argument checks."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from epjit import reference as ref
from epjit.errors import ArgumentError, ArgumentTypeError
from epjit.front.common import Plans
from epjit.kernels.low_latency import LOGFMT_CHANNELS
from epjit.reference import numerics
from epjit.reference.results import BF16

from .test_arguments import _hollow
from .test_reference import random_routing


def _bf16(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(BF16)


def _group(rng, scale: float) -> np.ndarray:
    return _bf16(rng.standard_normal(128) * scale)


def test_groups_reaching_one_travel_as_bf16():
    """A group with |x| >= 1 somewhere (log_amax >= 0), or with one magnitude throughout (log_amin == log_amax),
    or all zeros, comes back as its bf16 values exactly; a group below 1 is cast."""
    rng = np.random.default_rng(1)
    big = _group(rng, 0.1)
    big[17] = _bf16(-1.0)
    flat = _bf16(np.full(128, 0.25) * np.where(rng.random(128) < 0.5, -1, 1))
    zeros = _bf16(np.zeros(128))
    small = _group(rng, 0.1)
    row = np.concatenate([big, flat, zeros, small])[None]
    back = ref.logfmt_cast_back(row)
    assert back.dtype == np.float32 and back.shape == row.shape
    np.testing.assert_array_equal(back[0, :384], row[0, :384].astype(np.float32))
    assert not np.array_equal(back[0, 384:], small.astype(np.float32))  # cast: 9-bit magnitudes


def test_zeros_stay_zeros_and_signs_are_kept():
    rng = np.random.default_rng(2)
    group = _group(rng, 0.05)
    group[::7] = 0
    group[3] = _bf16(-0.0)
    back = ref.logfmt_cast_back(group[None])[0]
    x = group.astype(np.float32)
    np.testing.assert_array_equal(back[x == 0], 0)
    assert np.signbit(back[3])
    np.testing.assert_array_equal(np.sign(back[x != 0]), np.sign(x[x != 0]))


def test_cast_values_round_to_the_nearer_step():
    """A cast value lands on the log grid 2^(log_amin + j*step); the error is at most half a step in linear terms
    (2^step - 1 relative at the extreme), and amax itself is (nearly) exact."""
    rng = np.random.default_rng(3)
    group = _group(rng, 0.2)
    group[0] = _bf16(0.0)  # amin 0: log_amin = log_amax - 32, the widest grid
    x = group.astype(np.float32)
    back = ref.logfmt_cast_back(group[None])[0]
    amax = np.abs(x).max()
    step = 32.0 / 510
    nonzero = x != 0
    rel = np.abs(back[nonzero] - x[nonzero]) / np.abs(x[nonzero])
    assert rel.max() <= (2**step - 1) / 2 + 1e-6
    top = np.argmax(np.abs(x))
    assert abs(back[top] - x[top]) <= 1e-5 * amax


def test_rows_longer_than_a_group_are_cast_per_128_channels():
    rng = np.random.default_rng(4)
    a, b = _group(rng, 0.01), _group(rng, 0.3)
    joined = ref.logfmt_cast_back(np.concatenate([a, b])[None])[0]
    np.testing.assert_array_equal(joined[:128], ref.logfmt_cast_back(a[None])[0])
    np.testing.assert_array_equal(joined[128:], ref.logfmt_cast_back(b[None])[0])


@pytest.mark.parametrize("scale", [0.5, 0.1])
def test_logfmt_combine_within_deepeps_bound(scale):
    """DeepEP's own check of a LogFMT combine (its low-latency test with --use-logfmt): identity experts on
    randn * scale tokens (0.5 * random() there; 0.1 its performance case, where nearly every group is cast),
    calc_diff against x * sum of the weights < 1e-5; and against the bf16 combine."""
    rng = np.random.default_rng(5)
    num_ranks, num_experts, num_topk, hidden, num_max = 2, 16, 8, 7168, 32
    xs, idx, w = random_routing(rng, num_ranks, num_experts, num_topk, hidden, token_counts=[num_max, 24])
    xs = [_bf16(rng.standard_normal(x.shape) * scale) for x in xs]
    w = [np.abs(wt).astype(np.float32) for wt in w]
    d = ref.low_latency_dispatch(xs, idx, num_max, num_experts, use_fp8=False)
    ys, handles = [r.x for r in d], [r.handle for r in d]
    logfmt = ref.low_latency_combine(ys, idx, w, handles, use_logfmt=True)
    plain = ref.low_latency_combine(ys, idx, w, handles)
    cast = 0
    for r in range(num_ranks):
        expected = xs[r].astype(np.float32) * np.where(idx[r] >= 0, w[r], 0).sum(axis=1, keepdims=True)
        assert ref.calc_diff(logfmt[r].x, expected) < 1e-5
        assert ref.calc_diff(logfmt[r].x, plain[r].x) < 1e-5
        assert np.isfinite(logfmt[r].x.astype(np.float32)).all()
        cast += int(not np.array_equal(logfmt[r].x, plain[r].x))
    assert cast  # some groups were cast


def test_logfmt_combine_arguments():
    rng = np.random.default_rng(6)
    xs, idx, w = random_routing(rng, 2, 4, 2, 128, token_counts=[3, 2])
    d = ref.low_latency_dispatch(xs, idx, 4, 4, use_fp8=False)
    ys, handles = [r.x for r in d], [r.handle for r in d]
    with pytest.raises(ArgumentTypeError, match="use_logfmt must be True or False, got 'yes'"):
        ref.low_latency_combine(ys, idx, w, handles, use_logfmt="yes")
    xs, idx, w = random_routing(rng, 2, 4, 2, 64, token_counts=[3, 2])
    d = ref.low_latency_dispatch(xs, idx, 4, 4, use_fp8=False)
    with pytest.raises(ArgumentError, match="use_logfmt=True needs hidden % 128 == 0, hidden=64"):
        ref.low_latency_combine([r.x for r in d], idx, w, [r.handle for r in d], use_logfmt=True)
    with pytest.raises(ArgumentError, match="divisible by 128"):
        ref.logfmt_cast_back(np.zeros((2, 64), np.float32))


class _Found:
    """A plan cache that has every plan: the call goes on to its per-call checks."""

    def get(self, key, default=None):
        return object()


def _combine_front(hidden: int = 256, puts: bool = False):
    buf = _hollow()
    buf._low_latency.ops = SimpleNamespace(raise_status=lambda: None, check_handle=lambda handle, buffer_id: handle,
                                           puts=puts, is_combine_buffer=lambda address: True)
    buf._low_latency.plans = Plans()
    handle = SimpleNamespace(num_topk=2, num_max_dispatch_tokens_per_rank=8, hidden=hidden, num_experts=64)
    return buf, handle


def test_buffer_refuses_what_logfmt_cannot_do():
    """epjit.Buffer.low_latency_combine(use_logfmt=...): a flag given as text, a hidden size not of 128-channel
    groups, a Buffer with a put path (before any array is looked at); with zero_copy=True, as DeepEP asserts."""
    w = np.zeros((4, 2), np.float32)
    buf, handle = _combine_front()
    with pytest.raises(ArgumentTypeError, match=r"^use_logfmt must be True or False, got 'False'$"):
        buf.low_latency_combine(None, None, w, handle, use_logfmt="False")
    buf, handle = _combine_front(hidden=192)
    with pytest.raises(ArgumentError, match=r"use_logfmt=True needs hidden % 128 == 0 \(.*\), hidden=192"):
        buf.low_latency_combine(None, None, w, handle, use_logfmt=True)
    buf, handle = _combine_front(puts=True)
    with pytest.raises(ArgumentError, match="needs every peer reached through an NVLink pointer"):
        buf.low_latency_combine(None, None, w, handle, use_logfmt=True)
    buf, handle = _combine_front()
    buf._low_latency.plans = _Found()
    with pytest.raises(ArgumentError, match="zero_copy=True and use_logfmt=True together are not supported"):
        buf.low_latency_combine(None, None, w, handle, zero_copy=True, use_logfmt=True)


def test_group_constants_match_the_kernel():
    """The host's and the reference's LogFMT constants are the kernel's (cuda_src/low_latency.cu)."""
    source = (Path(__file__).parent.parent / "cuda_src" / "low_latency.cu").read_text()
    constants = dict(re.findall(r"constexpr (?:int|float) (kLogfmt\w+) = ([^;]+);", source))
    assert int(constants["kLogfmtChannels"]) == LOGFMT_CHANNELS == numerics.LOGFMT_CHANNELS
    assert constants["kLogfmtMaxIndex"] == "(1 << 9) - 1" and numerics.LOGFMT_MAX_INDEX == 511
    assert float(constants["kLogfmtMinClip"].rstrip("f")) == numerics.LOGFMT_MIN_CLIP
