"""Tests of the NumPy reference (epjit/reference/): hand-worked cases with every field written out, then
properties on random routings for 2 and 4 simulated ranks."""

from __future__ import annotations

import numpy as np
import pytest

from epjit import reference as ref
from epjit.errors import ArgumentError, ArgumentTypeError

BF16 = ref.BF16


def bf16(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(BF16)


def f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def bits(x: np.ndarray) -> np.ndarray:
    """Raw bits, so that comparisons are exact and NaN-safe."""
    return np.asarray(x).view(np.uint16 if np.asarray(x).dtype == BF16 else np.uint8)


# ----------------------------------------------------------------------------------------------------------------
# Hand-worked case: 2 ranks, 4 experts (rank 0 owns 0-1, rank 1 owns 2-3), top-2 with -1 holes, rank 1 has 0 tokens
# ----------------------------------------------------------------------------------------------------------------

HAND_X = [bf16([[1, 2], [3, 4], [5, 6]]), bf16(np.zeros((0, 2)))]
HAND_IDX = [np.array([[0, 3], [-1, 1], [2, -1]], dtype=np.int64), np.zeros((0, 2), dtype=np.int64)]
# The weight of a -1 slot (0.125 on token 1) must not travel.
HAND_W = [f32([[0.5, 0.25], [0.125, 0.75], [1.0, 0.5]]), np.zeros((0, 2), dtype=np.float32)]


def test_rank_of_expert():
    assert ref.rank_of_expert(0, 8, 4) == 0
    assert ref.rank_of_expert(5, 8, 4) == 2
    assert ref.rank_of_expert(7, 8, 4) == 3
    with pytest.raises(ArgumentError, match="num_experts=6 must be a positive multiple of num_ranks=4"):
        ref.rank_of_expert(0, 6, 4)
    with pytest.raises(ArgumentError, match="expert=8"):
        ref.rank_of_expert(8, 8, 4)


def test_layout_hand():
    layout = ref.get_dispatch_layout(HAND_IDX[0], 4, 2)
    np.testing.assert_array_equal(layout.is_token_in_rank, [[True, True], [True, False], [False, True]])
    assert layout.num_tokens_per_rank.dtype == np.int32
    np.testing.assert_array_equal(layout.num_tokens_per_rank, [2, 2])
    assert layout.num_tokens_per_expert.dtype == np.int32
    np.testing.assert_array_equal(layout.num_tokens_per_expert, [1, 1, 1, 1])
    assert layout.num_tokens_per_rdma_rank is None

    empty = ref.get_dispatch_layout(HAND_IDX[1], 4, 2)
    assert empty.is_token_in_rank.shape == (0, 2)
    np.testing.assert_array_equal(empty.num_tokens_per_rank, [0, 0])
    np.testing.assert_array_equal(empty.num_tokens_per_expert, [0, 0, 0, 0])


def test_layout_repeated_expert_counts_per_slot():
    # Token 0 names expert 1 twice: it counts twice for the expert, once for the rank.
    layout = ref.get_dispatch_layout(np.array([[1, 1], [1, 2]]), 4, 2)
    np.testing.assert_array_equal(layout.num_tokens_per_expert, [0, 3, 1, 0])
    np.testing.assert_array_equal(layout.num_tokens_per_rank, [2, 1])
    np.testing.assert_array_equal(layout.is_token_in_rank, [[True, False], [True, True]])


def test_layout_nvl_ranks_hand():
    # 4 ranks as 2 nodes x 2 GPUs, 8 experts (2 per rank, 4 per node).
    idx = np.array([[0, 2], [1, 7], [-1, -1], [5, 6], [4, 4]])
    layout = ref.get_dispatch_layout(idx, 8, 4, num_nvl_ranks=2)
    np.testing.assert_array_equal(layout.num_tokens_per_rank, [2, 1, 2, 2])
    # token 0: node 0 only; token 1: both nodes; token 3: node 1 once although it hits ranks 2 and 3; token 4: node 1.
    np.testing.assert_array_equal(layout.num_tokens_per_rdma_rank, [2, 3])
    assert layout.num_tokens_per_rdma_rank.dtype == np.int32
    np.testing.assert_array_equal(layout.num_tokens_per_expert, [1, 1, 1, 0, 2, 1, 1, 1])
    assert ref.get_dispatch_layout(idx, 8, 4, num_nvl_ranks=4).num_tokens_per_rdma_rank is None
    assert ref.get_dispatch_layout(idx, 8, 4).num_tokens_per_rdma_rank is None
    np.testing.assert_array_equal(
        ref.get_dispatch_layout(idx, 8, 4, num_nvl_ranks=1).num_tokens_per_rdma_rank, [2, 1, 2, 2]
    )
    with pytest.raises(ArgumentError, match="num_nvl_ranks=3"):
        ref.get_dispatch_layout(idx, 8, 4, num_nvl_ranks=3)


def test_dispatch_hand():
    d = ref.dispatch(HAND_X, HAND_IDX, HAND_W, 4)
    assert len(d) == 2
    r0, r1 = d
    # Rank 0 (experts 0, 1) receives tokens 0 and 1 of rank 0.
    np.testing.assert_array_equal(bits(r0.x), bits(bf16([[1, 2], [3, 4]])))
    assert r0.x_scales is None
    assert r0.topk_idx.dtype == np.int64
    np.testing.assert_array_equal(r0.topk_idx, [[0, -1], [-1, 1]])
    assert r0.topk_weights.dtype == np.float32
    np.testing.assert_array_equal(r0.topk_weights, [[0.5, 0.0], [0.0, 0.75]])
    assert r0.num_recv_tokens_per_expert == [1, 1]
    np.testing.assert_array_equal(r0.handle.src_rank, [0, 0])
    np.testing.assert_array_equal(r0.handle.src_token, [0, 1])
    assert r0.handle.src_rank.dtype == np.int32 and r0.handle.src_token.dtype == np.int32
    assert r0.handle.num_recv_tokens == 2 and r0.handle.num_rows == 2
    np.testing.assert_array_equal(r0.handle.is_token_in_rank, [[True, True], [True, False], [False, True]])
    np.testing.assert_array_equal(r0.handle.rank_prefix_matrix, [[2, 2], [2, 2]])
    # Rank 1 (experts 2, 3 -> local 0, 1) receives tokens 0 and 2 of rank 0.
    np.testing.assert_array_equal(bits(r1.x), bits(bf16([[1, 2], [5, 6]])))
    np.testing.assert_array_equal(r1.topk_idx, [[-1, 1], [0, -1]])
    np.testing.assert_array_equal(r1.topk_weights, [[0.0, 0.25], [1.0, 0.0]])
    assert r1.num_recv_tokens_per_expert == [1, 1]
    np.testing.assert_array_equal(r1.handle.src_rank, [0, 0])
    np.testing.assert_array_equal(r1.handle.src_token, [0, 2])
    assert r1.handle.is_token_in_rank.shape == (0, 2)


def test_dispatch_hand_alignment_and_worst_tokens():
    d = ref.dispatch(HAND_X, HAND_IDX, HAND_W, 4, expert_alignment=4, num_worst_tokens=3)
    r0, r1 = d
    assert r0.num_recv_tokens_per_expert == [4, 4]
    assert r1.num_recv_tokens_per_expert == [4, 4]
    np.testing.assert_array_equal(bits(r0.x), bits(bf16([[1, 2], [3, 4], [0, 0]])))
    np.testing.assert_array_equal(r0.topk_idx, [[0, -1], [-1, 1], [-1, -1]])
    np.testing.assert_array_equal(r0.topk_weights, [[0.5, 0.0], [0.0, 0.75], [0.0, 0.0]])
    np.testing.assert_array_equal(r1.topk_idx, [[-1, 1], [0, -1], [-1, -1]])
    assert r0.handle.num_recv_tokens == 2 and r0.handle.num_rows == 3
    assert len(r0.handle.src_token) == 2
    with pytest.raises(ArgumentError, match="rank 0 receives 2 tokens but num_worst_tokens=1"):
        ref.dispatch(HAND_X, HAND_IDX, HAND_W, 4, num_worst_tokens=1)


def test_dispatch_hand_repeated_expert():
    # Token 0 of rank 0 names expert 1 twice: delivered once to rank 0, local id in both slots, counted per slot.
    xs = [bf16([[1, 2], [3, 4]]), bf16([[5, 6]])]
    idx = [np.array([[1, 1], [1, 2]]), np.array([[3, 3]])]
    w = [f32([[0.5, 0.25], [0.125, 0.75]]), f32([[1, 2]])]
    r0, r1 = ref.dispatch(xs, idx, w, 4)
    np.testing.assert_array_equal(bits(r0.x), bits(bf16([[1, 2], [3, 4]])))
    np.testing.assert_array_equal(r0.topk_idx, [[1, 1], [1, -1]])
    np.testing.assert_array_equal(r0.topk_weights, [[0.5, 0.25], [0.125, 0.0]])
    assert r0.num_recv_tokens_per_expert == [0, 3]
    np.testing.assert_array_equal(r1.handle.src_rank, [0, 1])
    np.testing.assert_array_equal(r1.handle.src_token, [1, 0])
    np.testing.assert_array_equal(r1.topk_idx, [[-1, 0], [1, 1]])
    assert r1.num_recv_tokens_per_expert == [1, 2]
    # Combine returns each token once per rank, whatever the number of slots.
    c = ref.combine([r0.x, r1.x], [r0.handle, r1.handle])
    np.testing.assert_array_equal(bits(c[0].x), bits(bf16([[1, 2], [6, 8]])))
    np.testing.assert_array_equal(bits(c[1].x), bits(bf16([[5, 6]])))


def test_combine_hand():
    d = ref.dispatch(HAND_X, HAND_IDX, HAND_W, 4)
    ys = [bf16([[10, 20], [30, 40]]), bf16([[100, 200], [500, 600]])]
    c = ref.combine(ys, [r.handle for r in d], topk_weights=[r.topk_weights for r in d])
    assert c[0].x.dtype == BF16
    np.testing.assert_array_equal(bits(c[0].x), bits(bf16([[110, 220], [30, 40], [500, 600]])))
    # The -1 slot of token 1 had weight 0.125: it did not travel, so it comes back as 0.
    np.testing.assert_array_equal(c[0].topk_weights, [[0.5, 0.25], [0.0, 0.75], [1.0, 0.0]])
    assert c[0].topk_weights.dtype == np.float32
    assert c[1].x.shape == (0, 2) and c[1].topk_weights.shape == (0, 2)

    bias0 = [bf16(np.ones((3, 2))), bf16(np.zeros((0, 2)))]
    bias1 = [bf16(np.full((3, 2), 0.5)), bf16(np.zeros((0, 2)))]
    c = ref.combine(ys, [r.handle for r in d], bias=[(bias0[0], bias1[0]), (bias0[1], bias1[1])])
    np.testing.assert_array_equal(bits(c[0].x), bits(bf16([[111.5, 221.5], [31.5, 41.5], [501.5, 601.5]])))
    assert c[0].topk_weights is None
    c = ref.combine(ys, [r.handle for r in d], bias=bias0)
    np.testing.assert_array_equal(bits(c[0].x), bits(bf16([[111, 221], [31, 41], [501, 601]])))


def test_combine_ignores_padding_rows():
    d = ref.dispatch(HAND_X, HAND_IDX, HAND_W, 4, num_worst_tokens=4)
    ys = [
        bf16([[10, 20], [30, 40], [np.nan, np.nan], [np.inf, 1]]),
        bf16([[100, 200], [500, 600], [np.nan] * 2, [1, 1]]),
    ]
    c = ref.combine(ys, [r.handle for r in d])
    np.testing.assert_array_equal(bits(c[0].x), bits(bf16([[110, 220], [30, 40], [500, 600]])))


# 2 nodes x 2 ranks (num_nvl_ranks=2), 4 experts, one per rank. Rank 0 sends token 0 to every rank, token 1 to node 1
# only (ranks 2 and 3), and token 2 nowhere; ranks 1-3 have no tokens.
NODE_X = [bf16([[1, 1], [2, 2], [3, 3]])] + [bf16(np.zeros((0, 2)))] * 3
NODE_IDX = [np.array([[0, 1, 2, 3], [2, 3, -1, -1], [-1, -1, -1, -1]])] + [np.zeros((0, 4), np.int64)] * 3
NODE_W = [f32([[0.5, 0.25, 0.125, 0.0625], [1, 2, 4, 8], [3, 5, 6, 7]])] + [np.zeros((0, 4), np.float32)] * 3
# The rows each rank returns (rank 2 and 3: token 0, then token 1).
NODE_YS = [
    bf16([[1, 1]]),
    bf16([[2**-8, 3 * 2**-9]]),
    bf16([[2**-8, -(2**-9)], [3, 256]]),
    bf16([[0, 0], [0.5, 1]]),
]


def test_combine_two_nodes_hand():
    d = ref.dispatch(NODE_X, NODE_IDX, NODE_W, 4)
    handles = [r.handle for r in d]
    assert [h.src_token.tolist() for h in handles] == [[0], [0], [0, 1], [0, 1]]
    weights = [r.topk_weights for r in d]
    two = ref.combine(NODE_YS, handles, topk_weights=weights, num_nvl_ranks=2)
    one = ref.combine(NODE_YS, handles, topk_weights=weights)
    # bf16 near 1 has a step of 2**-7, so 1 + 2**-8 is a tie (to even: 1) and 1 + 3*2**-9 rounds up to 1 + 2**-7.
    # Token 0, channel 0. Two nodes: node 0 = bf16(1 + 2**-8) = 1, node 1 = bf16(2**-8 + 0) = 2**-8;
    #   x = bf16(1 + 2**-8) = 1. One rounding: bf16(1 + 2**-8 + 2**-8 + 0) = 1 + 2**-7 = 1.0078125.
    # Token 0, channel 1. Two nodes: node 0 = bf16(1 + 3*2**-9) = 1.0078125, node 1 = bf16(-2**-9 + 0) = -2**-9;
    #   x = bf16(1.0078125 - 0.001953125 = 1.005859375) = 1.0078125. One rounding: 1 + 3*2**-9 - 2**-9 =
    #   1.00390625, a tie: 1.
    # Token 1 (node 1 only): [bf16(3 + 0.5), bf16(256 + 1)] = [3.5, 256] either way (257 is a tie between 256 and
    # 258, to even: 256). Token 2 went nowhere: zeros.
    np.testing.assert_array_equal(bits(two[0].x), bits(bf16([[1.0, 1.0078125], [3.5, 256], [0, 0]])))
    np.testing.assert_array_equal(bits(one[0].x), bits(bf16([[1.0078125, 1.0], [3.5, 256], [0, 0]])))
    # Four nodes of one rank: every partial is one bf16 row, so the one-rounding result.
    np.testing.assert_array_equal(bits(ref.combine(NODE_YS, handles, num_nvl_ranks=1)[0].x), bits(one[0].x))
    # Weights are never rounded: the slots that named an expert come back, the -1 slots as 0.
    expected_w = [[0.5, 0.25, 0.125, 0.0625], [1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    np.testing.assert_array_equal(two[0].topk_weights, expected_w)
    np.testing.assert_array_equal(one[0].topk_weights, expected_w)
    for r in (1, 2, 3):
        assert two[r].x.shape == (0, 2) and two[r].topk_weights.shape == (0, 4)


# ----------------------------------------------------------------------------------------------------------------
# Hand-worked FP8
# ----------------------------------------------------------------------------------------------------------------


def _fp8_hand_rows() -> np.ndarray:
    x = np.zeros((4, 128), dtype=np.float32)
    x[0, :4] = [448, -448, 1, 0.5]  # amax 448: scale 1
    # row 1 all zero: amax is floored at 1e-4
    x[2, :4] = [3.5, 1.0, 17 / 128, 19 / 128]  # amax 3.5: scale 2**-7 exactly; 17 and 19 are ties for e4m3
    x[3, :3] = [1.0, 0.5, -0.25]  # amax 1: scale 1/448, or 2**-8 with round_scale
    return x


def test_fp8_hand():
    q, s = ref.per_token_cast_to_fp8(bf16(_fp8_hand_rows()))
    assert q.dtype == np.uint8 and q.shape == (4, 128)
    assert s.dtype == np.float32 and s.shape == (4, 1)
    np.testing.assert_array_equal(
        s[:, 0], f32([1.0, np.float32(1e-4) / np.float32(448), 2.0**-7, np.float32(1.0) / np.float32(448)])
    )
    # e4m3fn bits: 448 = 0x7E, -448 = 0xFE, 1 = 0x38, 0.5 = 0x30, 0 = 0x00.
    np.testing.assert_array_equal(q[0, :5], [0x7E, 0xFE, 0x38, 0x30, 0x00])
    assert not q[1].any()
    # 3.5*128 = 448 = 0x7E; 128 = 0x70; 17 rounds to even 16 = 0x58; 19 rounds to even 20 = 0x5A.
    np.testing.assert_array_equal(q[2, :4], [0x7E, 0x70, 0x58, 0x5A])


def test_fp8_hand_round_scale_and_ue8m0():
    x = bf16(_fp8_hand_rows())
    q, s = ref.per_token_cast_to_fp8(x, round_scale=True)
    # Smallest powers of two >= 1, 1e-4/448 (2.23e-7 -> 2**-22), 2**-7, 1/448 (-> 2**-8).
    np.testing.assert_array_equal(s[:, 0], f32([1.0, 2.0**-22, 2.0**-7, 2.0**-8]))
    np.testing.assert_array_equal(q[3, :4], [0x78, 0x70, 0xE8, 0x00])  # 256, 128, -64, 0
    q8, b = ref.per_token_cast_to_fp8(x, use_ue8m0=True)  # implies round_scale
    assert b.dtype == np.uint8 and b.shape == (4, 1)
    np.testing.assert_array_equal(b[:, 0], [127, 105, 120, 119])
    np.testing.assert_array_equal(q8, q)
    np.testing.assert_array_equal(ref.ue8m0_to_float(b), s)
    np.testing.assert_array_equal(ref.fp8_to_float(q8, b), ref.fp8_to_float(q, s))
    np.testing.assert_array_equal(ref.fp8_to_float(q, s)[3, :3], [1.0, 0.5, -0.25])


def test_fp8_views():
    q = np.array([[0x38, 0x7E, 0xB0, 0x01]], dtype=np.uint8)
    assert ref.fp8_bits_as_float8(q).dtype == ref.FP8
    np.testing.assert_array_equal(ref.fp8_bits_to_float32(q), [[1.0, 448.0, -0.5, 2.0**-9]])
    assert ref.fp8_bits_to_float32(q).dtype == np.float32
    assert np.isnan(ref.ue8m0_to_float(np.array([255], np.uint8))[0])


def test_fp8_hidden_must_be_multiple_of_128():
    with pytest.raises(ArgumentError, match="hidden=100"):
        ref.per_token_cast_to_fp8(bf16(np.ones((2, 100))))


# ----------------------------------------------------------------------------------------------------------------
# Hand-worked low-latency case: 2 ranks, 4 experts, max 3 tokens; rank 1's token 1 names expert 0 twice
# ----------------------------------------------------------------------------------------------------------------

LL_X = [bf16([[1, 2], [3, 4], [5, 6]]), bf16([[7, 8], [9, 10]])]
LL_IDX = [np.array([[0, 3], [-1, 1], [2, -1]]), np.array([[1, 3], [0, 0]])]
LL_W = [f32([[0.5, 0.25], [0.125, 0.75], [1.0, 0.5]]), f32([[0.5, 0.5], [0.25, 0.75]])]


def test_low_latency_dispatch_hand():
    r0, r1 = ref.low_latency_dispatch(LL_X, LL_IDX, 3, 4, use_fp8=False)
    assert r0.x.shape == (2, 6, 2) and r0.x.dtype == BF16 and r0.x_scales is None
    assert r0.recv_count.dtype == np.int32 and r0.src_info.dtype == np.int32 and r0.layout_range.dtype == np.int64
    # Rank 0, expert 0: token 0 of rank 0, then token 1 of rank 1 twice (one row per slot).
    np.testing.assert_array_equal(r0.recv_count, [3, 2])
    np.testing.assert_array_equal(bits(r0.x[0, :3]), bits(bf16([[1, 2], [9, 10], [9, 10]])))
    np.testing.assert_array_equal(r0.src_info[0, :3], [0, 1, 1])
    np.testing.assert_array_equal(r0.layout_range[0], [0 << 32 | 1, 1 << 32 | 2])
    # Rank 0, expert 1: token 1 of rank 0, token 0 of rank 1.
    np.testing.assert_array_equal(bits(r0.x[1, :2]), bits(bf16([[3, 4], [7, 8]])))
    np.testing.assert_array_equal(r0.src_info[1, :2], [1, 0])
    np.testing.assert_array_equal(r0.layout_range[1], [0 << 32 | 1, 1 << 32 | 1])
    # Rank 1, expert 2 (local 0): token 2 of rank 0 only; expert 3: token 0 of rank 0 and token 0 of rank 1.
    np.testing.assert_array_equal(r1.recv_count, [1, 2])
    np.testing.assert_array_equal(bits(r1.x[0, :1]), bits(bf16([[5, 6]])))
    np.testing.assert_array_equal(r1.src_info[0, :1], [2])
    np.testing.assert_array_equal(r1.layout_range[0], [0 << 32 | 1, 1 << 32 | 0])
    np.testing.assert_array_equal(bits(r1.x[1, :2]), bits(bf16([[1, 2], [7, 8]])))
    np.testing.assert_array_equal(r1.src_info[1, :2], [0, 0])
    np.testing.assert_array_equal(r1.layout_range[1], [0 << 32 | 1, 1 << 32 | 1])
    # Rows past recv_count are poison.
    assert np.isnan(r0.x[0, 3:].astype(np.float32)).all() and np.isnan(r1.x[0, 1:].astype(np.float32)).all()
    assert (r0.src_info[1, 2:] == ref.POISON_SRC_INFO).all()
    assert r0.handle.num_max_dispatch_tokens_per_rank == 3 and r0.handle.hidden == 2
    assert r0.handle.num_experts == 4 and r0.handle.num_ranks == 2 and r0.handle.num_local_experts == 2


def test_low_latency_combine_hand():
    d = ref.low_latency_dispatch(LL_X, LL_IDX, 3, 4, use_fp8=False)
    nan = np.nan
    # Expert outputs in the received layout; NaN in every row that is not a received row.
    ys = [
        bf16(
            [
                [[1, 1], [2, 2], [4, 4], [nan] * 2, [nan] * 2, [nan] * 2],
                [[8, 8], [16, 16], [nan] * 2, [nan] * 2, [nan] * 2, [nan] * 2],
            ]
        ),
        bf16(
            [
                [[32, 32], [nan] * 2, [nan] * 2, [nan] * 2, [nan] * 2, [nan] * 2],
                [[64, 64], [128, 128], [nan] * 2, [nan] * 2, [nan] * 2, [nan] * 2],
            ]
        ),
    ]
    out = [c.x for c in ref.low_latency_combine(ys, LL_IDX, LL_W, [r.handle for r in d])]
    # Rank 0: t0 = 0.5*1 + 0.25*64; t1 = 0.75*8 (its -1 slot ignored); t2 = 1.0*32.
    np.testing.assert_array_equal(bits(out[0]), bits(bf16([[16.5] * 2, [6] * 2, [32] * 2])))
    # Rank 1: u0 = 0.5*16 + 0.5*128; u1 = 0.25*2 + 0.75*4 (expert 0 twice: one row per slot).
    np.testing.assert_array_equal(bits(out[1]), bits(bf16([[72] * 2, [3.5] * 2])))
    assert out[0].dtype == BF16


def test_low_latency_fp8_hand():
    xs = [bf16(_fp8_hand_rows()[:2]), bf16(_fp8_hand_rows()[2:])]
    idx = [np.array([[1], [0]]), np.array([[1], [1]])]
    r0, r1 = ref.low_latency_dispatch(xs, idx, 2, 2, use_fp8=True)
    q, s = ref.per_token_cast_to_fp8(bf16(_fp8_hand_rows()))
    assert r0.x.dtype == np.uint8 and r0.x.shape == (1, 4, 128) and r0.x_scales.shape == (1, 4, 1)
    np.testing.assert_array_equal(r0.recv_count, [1])
    np.testing.assert_array_equal(r0.x[0, 0], q[1])
    np.testing.assert_array_equal(r0.x_scales[0, 0], s[1])
    assert (r0.x[0, 1:] == ref.POISON_FP8_BITS).all() and np.isnan(r0.x_scales[0, 1:]).all()
    np.testing.assert_array_equal(r1.recv_count, [3])
    np.testing.assert_array_equal(r1.x[0, :3], q[[0, 2, 3]])
    np.testing.assert_array_equal(r1.src_info[0, :3], [0, 0, 1])
    np.testing.assert_array_equal(r1.layout_range[0], [0 << 32 | 1, 1 << 32 | 2])
    r0, r1 = ref.low_latency_dispatch(xs, idx, 2, 2, use_ue8m0=True)
    assert r1.x_scales.dtype == np.uint8
    np.testing.assert_array_equal(r1.x_scales[0, :3, 0], [127, 120, 119])
    assert (r1.x_scales[0, 3:] == ref.POISON_UE8M0).all()


# ----------------------------------------------------------------------------------------------------------------
# Properties on random routings
# ----------------------------------------------------------------------------------------------------------------


def random_routing(rng, num_ranks, num_experts, num_topk, hidden, token_counts=None, hole_prob=0.25, integer=False):
    """Random distinct top-k experts per token with -1 holes; token 0 of each non-empty rank routes nowhere."""
    if token_counts is None:
        token_counts = [int(n) for n in rng.integers(0, 40, size=num_ranks)]
        token_counts[-1] = 0  # always one rank with no tokens
        token_counts[0] = 33  # and an odd count
    xs, idx, weights = [], [], []
    for n in token_counts:
        chosen = np.argsort(rng.random((n, num_experts)), axis=1)[:, :num_topk].astype(np.int64)
        chosen[rng.random((n, num_topk)) < hole_prob] = -1
        if n:
            chosen[0] = -1
        values = rng.integers(-8, 9, size=(n, hidden)) if integer else rng.standard_normal((n, hidden))
        xs.append(bf16(values))
        idx.append(chosen)
        weights.append(rng.random((n, num_topk), dtype=np.float32))
    return xs, idx, weights


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_dispatch_properties(num_ranks):
    rng = np.random.default_rng(num_ranks)
    num_experts, num_topk, hidden = 8 * num_ranks, 4, 64
    num_local = num_experts // num_ranks
    xs, idx, w = random_routing(rng, num_ranks, num_experts, num_topk, hidden)
    layouts = [ref.get_dispatch_layout(i, num_experts, num_ranks) for i in idx]
    d = ref.dispatch(xs, idx, w, num_experts)
    for r in range(num_ranks):
        h = d[r].handle
        # Exactly the tokens with an expert on r, ordered by (source rank, source token).
        expected = [
            (s, t)
            for s in range(num_ranks)
            for t in range(len(xs[s]))
            if ((idx[s][t] >= r * num_local) & (idx[s][t] < (r + 1) * num_local)).any()
        ]
        assert list(zip(h.src_rank.tolist(), h.src_token.tolist(), strict=True)) == expected
        assert h.num_recv_tokens == len(expected) == d[r].x.shape[0]
        for row, (s, t) in enumerate(expected):
            assert np.array_equal(bits(d[r].x[row]), bits(xs[s][t]))
            g = idx[s][t]
            mine = (g >= r * num_local) & (g < (r + 1) * num_local)
            np.testing.assert_array_equal(d[r].topk_idx[row], np.where(mine, g - r * num_local, -1))
            np.testing.assert_array_equal(d[r].topk_weights[row], np.where(mine, w[s][t], 0))
        per_expert = sum(
            layouts[s].num_tokens_per_expert[r * num_local : (r + 1) * num_local] for s in range(num_ranks)
        )
        assert d[r].num_recv_tokens_per_expert == per_expert.tolist()
        counts = np.array([lay.num_tokens_per_rank for lay in layouts])
        np.testing.assert_array_equal(h.rank_prefix_matrix, np.cumsum(counts, axis=0))
        assert h.rank_prefix_matrix[-1, r] == h.num_recv_tokens


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_expert_alignment(num_ranks):
    rng = np.random.default_rng(10 + num_ranks)
    xs, idx, w = random_routing(rng, num_ranks, 4 * num_ranks, 3, 16)
    plain = ref.dispatch(xs, idx, w, 4 * num_ranks)
    for alignment in (1, 3, 8, 128):
        aligned = ref.dispatch(xs, idx, w, 4 * num_ranks, expert_alignment=alignment)
        for p, a in zip(plain, aligned, strict=True):
            for c, ca in zip(p.num_recv_tokens_per_expert, a.num_recv_tokens_per_expert, strict=True):
                assert ca % alignment == 0 and c <= ca < c + alignment
            assert np.array_equal(bits(p.x), bits(a.x))


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_dispatch_combine_adjoint_exact(num_ranks):
    # Small integers: every bf16 value and every float32 sum is exact, so <dispatch(x), y> == <x, combine(y)>
    # holds exactly in float64.
    rng = np.random.default_rng(20 + num_ranks)
    num_experts, hidden = 4 * num_ranks, 32
    xs, idx, w = random_routing(rng, num_ranks, num_experts, 3, hidden, integer=True)
    d = ref.dispatch(xs, idx, w, num_experts)
    ys = [bf16(rng.integers(-8, 9, size=r.x.shape)) for r in d]
    c = ref.combine(ys, [r.handle for r in d])
    lhs = sum(np.sum(r.x.astype(np.float64) * y.astype(np.float64)) for r, y in zip(d, ys, strict=True))
    rhs = sum(np.sum(x.astype(np.float64) * cr.x.astype(np.float64)) for x, cr in zip(xs, c, strict=True))
    assert lhs == rhs and lhs != 0


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_dispatch_combine_adjoint_random(num_ranks):
    rng = np.random.default_rng(30 + num_ranks)
    num_experts, hidden = 4 * num_ranks, 128
    xs, idx, w = random_routing(rng, num_ranks, num_experts, 4, hidden)
    d = ref.dispatch(xs, idx, w, num_experts)
    ys = [bf16(rng.standard_normal(r.x.shape)) for r in d]
    c = ref.combine(ys, [r.handle for r in d])
    lhs = sum(np.sum(r.x.astype(np.float64) * y.astype(np.float64)) for r, y in zip(d, ys, strict=True))
    rhs = sum(np.sum(x.astype(np.float64) * cr.x.astype(np.float64)) for x, cr in zip(xs, c, strict=True))
    # Only the final bf16 rounding of the combine output separates the two sides.
    scale = sum(np.sum(np.abs(x.astype(np.float64) * cr.x.astype(np.float64))) for x, cr in zip(xs, c, strict=True))
    assert abs(lhs - rhs) <= 2**-8 * scale


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_combine_of_dispatch_multiplies_by_rank_count(num_ranks):
    rng = np.random.default_rng(40 + num_ranks)
    num_experts = 2 * num_ranks
    xs, idx, w = random_routing(rng, num_ranks, num_experts, 3, 64)
    d = ref.dispatch(xs, idx, w, num_experts)
    c = ref.combine([r.x for r in d], [r.handle for r in d], topk_weights=[r.topk_weights for r in d])
    for s in range(num_ranks):
        in_rank = ref.get_dispatch_layout(idx[s], num_experts, num_ranks).is_token_in_rank
        times = in_rank.sum(axis=1).astype(np.float32)
        # (+ 0 turns the -0 of a negative value sent nowhere into the +0 that the float32 accumulator starts at)
        expected = (xs[s].astype(np.float32) * times[:, None] + np.float32(0)).astype(BF16)
        np.testing.assert_array_equal(bits(c[s].x), bits(expected))
        if len(times) > 0:
            assert times[0] == 0 and not c[s].x[0].astype(np.float32).any()
        np.testing.assert_array_equal(c[s].topk_weights, np.where(idx[s] >= 0, w[s], 0))


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_worst_tokens_padding(num_ranks):
    rng = np.random.default_rng(50 + num_ranks)
    num_experts = 2 * num_ranks
    xs, idx, w = random_routing(rng, num_ranks, num_experts, 2, 32)
    plain = ref.dispatch(xs, idx, w, num_experts)
    most = max(r.handle.num_recv_tokens for r in plain)
    worst = ref.dispatch(xs, idx, w, num_experts, num_worst_tokens=most + 3)
    ys_plain = [bf16(rng.standard_normal(p.x.shape)) for p in plain]
    ys_worst = []
    for p, q, y in zip(plain, worst, ys_plain, strict=True):
        m = p.handle.num_recv_tokens
        assert q.x.shape[0] == q.topk_idx.shape[0] == q.topk_weights.shape[0] == most + 3 == q.handle.num_rows
        assert np.array_equal(bits(q.x[:m]), bits(p.x))
        np.testing.assert_array_equal(q.topk_idx[:m], p.topk_idx)
        assert (q.topk_idx[m:] == -1).all() and (q.topk_weights[m:] == 0).all()
        assert not q.x[m:].astype(np.float32).any()
        assert q.num_recv_tokens_per_expert == p.num_recv_tokens_per_expert
        padded = np.full((most + 3, y.shape[1]), np.nan, dtype=np.float32).astype(BF16)
        padded[:m] = y
        ys_worst.append(padded)
    c_plain = ref.combine(ys_plain, [p.handle for p in plain])
    c_worst = ref.combine(ys_worst, [q.handle for q in worst])
    for a, b in zip(c_plain, c_worst, strict=True):
        assert np.array_equal(bits(a.x), bits(b.x))
    worst_rank = [r.handle.num_recv_tokens for r in plain].index(most)
    with pytest.raises(ArgumentError, match=f"rank {worst_rank} receives {most} tokens"):
        ref.dispatch(xs, idx, w, num_experts, num_worst_tokens=most - 1)


def random_combine_case(seed, num_ranks, hidden=64):
    """A random routing dispatched, random expert outputs, a (bf16, float32) bias pair and the received weights."""
    rng = np.random.default_rng(seed)
    num_experts = 2 * num_ranks
    xs, idx, w = random_routing(rng, num_ranks, num_experts, 3, hidden)
    d = ref.dispatch(xs, idx, w, num_experts)
    ys = [bf16(rng.standard_normal(r.x.shape)) for r in d]
    bias = [(bf16(rng.standard_normal(x.shape)), rng.standard_normal(x.shape).astype(np.float32)) for x in xs]
    return idx, w, ys, [r.handle for r in d], bias, [r.topk_weights for r in d]


def two_level_combine_loop(ys, handles, bias, num_nvl_ranks):
    """The internode combine written plainly: one token, one node, one rank at a time."""
    num_ranks, hidden = len(handles), ys[0].shape[1]
    row_of = [
        {(int(s), int(t)): row for row, (s, t) in enumerate(zip(h.src_rank, h.src_token, strict=True))}
        for h in handles
    ]
    out = []
    for s in range(num_ranks):
        x = np.zeros((handles[s].is_token_in_rank.shape[0], hidden), dtype=BF16)
        for t in range(x.shape[0]):
            acc = np.float32(0) + bias[s][0][t].astype(np.float32) + bias[s][1][t].astype(np.float32)
            for m in range(num_ranks // num_nvl_ranks):
                partial = None
                for j in range(num_nvl_ranks):
                    r = m * num_nvl_ranks + j
                    if (s, t) in row_of[r]:
                        y = ys[r][row_of[r][s, t]].astype(np.float32)
                        partial = (np.zeros(hidden, np.float32) if partial is None else partial) + y
                if partial is not None:
                    acc = acc + partial.astype(BF16).astype(np.float32)
            x[t] = acc.astype(BF16)
        out.append(x)
    return out


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_combine_one_node_is_intranode(num_ranks):
    # num_nvl_ranks = R (one node) and None are the intranode formula, exactly the call without the argument.
    _, _, ys, handles, bias, weights = random_combine_case(90 + num_ranks, num_ranks)
    plain = ref.combine(ys, handles, topk_weights=weights, bias=bias)
    for nvl in (None, num_ranks, np.int64(num_ranks)):
        c = ref.combine(ys, handles, topk_weights=weights, bias=bias, num_nvl_ranks=nvl)
        for a, b in zip(plain, c, strict=True):
            np.testing.assert_array_equal(bits(a.x), bits(b.x))
            np.testing.assert_array_equal(a.topk_weights, b.topk_weights)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_combine_one_rank_nodes_is_intranode(num_ranks):
    # V = 1: each node partial is a single bf16 row, which bf16 rounding leaves as it is.
    _, _, ys, handles, bias, weights = random_combine_case(100 + num_ranks, num_ranks)
    plain = ref.combine(ys, handles, topk_weights=weights, bias=bias)
    c = ref.combine(ys, handles, topk_weights=weights, bias=bias, num_nvl_ranks=1)
    for a, b in zip(plain, c, strict=True):
        np.testing.assert_array_equal(bits(a.x), bits(b.x))
        np.testing.assert_array_equal(a.topk_weights, b.topk_weights)


@pytest.mark.parametrize(("num_nodes", "num_nvl_ranks"), [(2, 2), (4, 2)])
def test_combine_two_level_matches_loop(num_nodes, num_nvl_ranks):
    num_ranks = num_nodes * num_nvl_ranks
    idx, w, ys, handles, bias, weights = random_combine_case(110 + num_ranks, num_ranks)
    c = ref.combine(ys, handles, topk_weights=weights, bias=bias, num_nvl_ranks=num_nvl_ranks)
    plain = ref.combine(ys, handles, topk_weights=weights, bias=bias)
    expected = two_level_combine_loop(ys, handles, bias, num_nvl_ranks)
    for s in range(num_ranks):
        np.testing.assert_array_equal(bits(c[s].x), bits(expected[s]))
        # Each slot sums one weight and zeros, whatever the grouping: the original weights, exactly.
        np.testing.assert_array_equal(c[s].topk_weights, plain[s].topk_weights)
        np.testing.assert_array_equal(c[s].topk_weights, np.where(idx[s] >= 0, w[s], 0))
    # The node partials' rounding shows somewhere (else this test would not tell the formulas apart).
    assert any(not np.array_equal(bits(a.x), bits(b.x)) for a, b in zip(c, plain, strict=True))


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_dispatch_fp8_carries_bits_and_scales(num_ranks):
    rng = np.random.default_rng(60 + num_ranks)
    num_experts = 2 * num_ranks
    xs, idx, w = random_routing(rng, num_ranks, num_experts, 2, 256)
    quantised = [ref.per_token_cast_to_fp8(x) for x in xs]
    d_bf16 = ref.dispatch(xs, idx, w, num_experts)
    # FP8 accepted as uint8 bits or as float8_e4m3fn values; results carry uint8 bits.
    d_fp8 = ref.dispatch(
        [ref.fp8_bits_as_float8(q) for q, _ in quantised], idx, w, num_experts, x_scales=[s for _, s in quantised]
    )
    for b, f in zip(d_bf16, d_fp8, strict=True):
        h = f.handle
        assert f.x.dtype == np.uint8 and f.x_scales.dtype == np.float32
        expected_q = np.concatenate([quantised[s][0][h.src_token[h.src_rank == s]] for s in range(num_ranks)])
        expected_s = np.concatenate([quantised[s][1][h.src_token[h.src_rank == s]] for s in range(num_ranks)])
        np.testing.assert_array_equal(f.x, expected_q)
        np.testing.assert_array_equal(f.x_scales, expected_s)
        np.testing.assert_array_equal(f.topk_idx, b.topk_idx)
        if len(f.x):
            assert ref.calc_diff(ref.fp8_to_float(f.x, f.x_scales), b.x) < 1e-3


def test_layout_nvl_ranks_random():
    rng = np.random.default_rng(70)
    idx = random_routing(rng, 8, 32, 6, 1, token_counts=[200])[1][0]
    for nvl in (1, 2, 4):
        layout = ref.get_dispatch_layout(idx, 32, 8, num_nvl_ranks=nvl)
        node = np.where(idx >= 0, idx // (4 * nvl), -1)
        expected = [int((node == n).any(axis=1).sum()) for n in range(8 // nvl)]
        assert layout.num_tokens_per_rdma_rank.tolist() == expected
        # A token counts once per node, so per node <= the sum of its ranks' counts.
        per_rank = layout.num_tokens_per_rank.reshape(-1, nvl).sum(axis=1)
        assert (layout.num_tokens_per_rdma_rank <= per_rank).all()
    assert layout.num_tokens_per_expert.sum() == (idx >= 0).sum()


def test_fp8_round_trip_bound():
    rng = np.random.default_rng(80)
    x = rng.standard_normal((64, 512)) * np.exp(rng.uniform(-6, 6, size=(64, 1)))
    x[3] = 0.0
    x[5, 128:256] = 1e-7  # below the amax floor
    xb = bf16(x)
    xf = xb.astype(np.float32)
    for round_scale in (False, True):
        q, s = ref.per_token_cast_to_fp8(xb, round_scale=round_scale)
        back = ref.fp8_to_float(q, s)
        scale = np.repeat(s, 128, axis=1)
        # e4m3: 3 mantissa bits (relative error <= 2**-4), smallest subnormal 2**-9 of the scale (absolute 2**-10).
        bound = np.abs(xf) * 2.0**-4 * (1 + 1e-6) + scale * 2.0**-10
        assert (np.abs(back - xf) <= bound).all()
        assert not (q == ref.POISON_FP8_BITS).any() and not (q == 0xFF).any()  # never NaN
        amax = np.maximum(np.abs(xf).reshape(64, 4, 128).max(axis=2), np.float32(1e-4))
        if round_scale:
            exponent = np.log2(s)
            assert (exponent == np.round(exponent)).all()
            assert (s >= amax / 448).all() and (s / 2 < amax / 448).all()
        else:
            np.testing.assert_array_equal(s, amax / np.float32(448))
        assert ref.calc_diff(back, xf) < 1e-3


def test_ue8m0_bytes_match_round_scale():
    rng = np.random.default_rng(90)
    x = bf16(rng.standard_normal((16, 384)) * np.exp(rng.uniform(-20, 20, size=(16, 1))))
    q, s = ref.per_token_cast_to_fp8(x, round_scale=True)
    q8, b = ref.per_token_cast_to_fp8(x, round_scale=False, use_ue8m0=True)
    np.testing.assert_array_equal(q8, q)
    assert b.dtype == np.uint8 and b.shape == (16, 3)
    np.testing.assert_array_equal(b.astype(np.float64), np.log2(s.astype(np.float64)) + 127)
    np.testing.assert_array_equal((b.astype(np.uint32) << 23).view(np.float32), s)


def check_low_latency_layout(result, idx, num_max, num_experts, rank):
    """layout_range blocks tile [0, recv_count) in source order and src_info names the slots' tokens."""
    num_ranks = len(idx)
    num_local = num_experts // num_ranks
    begin, count = ref.unpack_layout_range(result.layout_range)
    for e in range(num_local):
        g = rank * num_local + e
        start = 0
        for s in range(num_ranks):
            assert begin[e, s] == start
            tokens = np.nonzero(idx[s] == g)[0]  # one entry per (token, k) slot, ascending
            assert count[e, s] == len(tokens)
            np.testing.assert_array_equal(result.src_info[e, start : start + len(tokens)], tokens)
            start += len(tokens)
        assert result.recv_count[e] == start <= num_ranks * num_max
        assert (result.src_info[e, start:] == ref.POISON_SRC_INFO).all()


def low_latency_case(num_ranks, seed, hidden=256, num_max=24, num_local=3, num_topk=4):
    rng = np.random.default_rng(seed)
    num_experts = num_local * num_ranks
    counts = [num_max, 0] + [int(n) for n in rng.integers(1, num_max + 1, size=num_ranks - 2)]
    xs, idx, w = random_routing(rng, num_ranks, num_experts, num_topk, hidden, token_counts=counts)
    return rng, num_experts, xs, idx, w


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_low_latency_dispatch_properties(num_ranks):
    rng, num_experts, xs, idx, w = low_latency_case(num_ranks, 100 + num_ranks)
    num_max, num_local = 24, num_experts // num_ranks
    plain = ref.low_latency_dispatch(xs, idx, num_max, num_experts, use_fp8=False)
    fp8 = ref.low_latency_dispatch(xs, idx, num_max, num_experts)
    ue8m0 = ref.low_latency_dispatch(xs, idx, num_max, num_experts, use_ue8m0=True)
    rounded = ref.low_latency_dispatch(xs, idx, num_max, num_experts, round_scale=True)
    quantised = [ref.per_token_cast_to_fp8(x) for x in xs]
    for r in range(num_ranks):
        for res in (plain[r], fp8[r], ue8m0[r]):
            assert res.x.shape[:2] == (num_local, num_ranks * num_max)
            check_low_latency_layout(res, idx, num_max, num_experts, r)
        assert plain[r].recv_count.sum() == sum(((i >= r * num_local) & (i < (r + 1) * num_local)).sum() for i in idx)
        for e in range(num_local):
            begin, count = ref.unpack_layout_range(plain[r].layout_range[e])
            for s in range(num_ranks):
                rows = slice(int(begin[s]), int(begin[s] + count[s]))
                tokens = plain[r].src_info[e, rows]
                assert np.array_equal(bits(plain[r].x[e, rows]), bits(xs[s][tokens]))
                np.testing.assert_array_equal(fp8[r].x[e, rows], quantised[s][0][tokens])
                np.testing.assert_array_equal(fp8[r].x_scales[e, rows], quantised[s][1][tokens])
            n = plain[r].recv_count[e]
            assert np.isnan(plain[r].x[e, n:].astype(np.float32)).all()
            assert (fp8[r].x[e, n:] == ref.POISON_FP8_BITS).all() and np.isnan(fp8[r].x_scales[e, n:]).all()
            assert (ue8m0[r].x_scales[e, n:] == ref.POISON_UE8M0).all()
            np.testing.assert_array_equal(ue8m0[r].x[e, :n], rounded[r].x[e, :n])
            np.testing.assert_array_equal(ref.ue8m0_to_float(ue8m0[r].x_scales[e, :n]), rounded[r].x_scales[e, :n])


def dense_low_latency_combine(xs, idx, w, num_experts):
    """The combine written from its definition, with expert g's output = bf16(x * (g + 1))."""
    outputs = []
    for x, i, wt in zip(xs, idx, w, strict=True):
        acc = np.zeros(x.shape, dtype=np.float32)
        for k in range(i.shape[1]):
            valid = i[:, k] >= 0
            y = (x.astype(np.float32) * (i[:, k : k + 1] + 1).astype(np.float32)).astype(BF16).astype(np.float32)
            acc += np.where(valid[:, None], y * wt[:, k : k + 1], 0)
        outputs.append(acc.astype(BF16))
    return outputs


def expert_outputs(results, num_experts):
    """Apply expert g: y = bf16(x * (g + 1)) in each rank's received layout (garbage rows stay NaN)."""
    num_ranks = len(results)
    num_local = num_experts // num_ranks
    ys = []
    for r, res in enumerate(results):
        factor = (r * num_local + np.arange(num_local) + 1).astype(np.float32)[:, None, None]
        ys.append((res.x.astype(np.float32) * factor).astype(BF16))
    return ys


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_low_latency_combine_matches_dense(num_ranks):
    rng, num_experts, xs, idx, w = low_latency_case(num_ranks, 200 + num_ranks)
    d = ref.low_latency_dispatch(xs, idx, 24, num_experts, use_fp8=False)
    ys = expert_outputs(d, num_experts)
    out = [c.x for c in ref.low_latency_combine(ys, idx, w, [r.handle for r in d])]
    expected = dense_low_latency_combine(xs, idx, w, num_experts)
    for o, e in zip(out, expected, strict=True):
        assert o.dtype == BF16 and o.shape == e.shape
        assert np.isfinite(o.astype(np.float32)).all()  # the NaN garbage rows were never read
        np.testing.assert_allclose(o.astype(np.float32), e.astype(np.float32), rtol=2**-7, atol=1e-6)
        if o.size:
            assert ref.calc_diff(o, e) < 1e-5


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_low_latency_other_row_order(num_ranks):
    # A kernel may order source blocks and rows inside them differently: combine must give the same result, and
    # sort_low_latency_result must bring the layout back to the reference one.
    rng, num_experts, xs, idx, w = low_latency_case(num_ranks, 300 + num_ranks)
    d = ref.low_latency_dispatch(xs, idx, 24, num_experts)
    shuffled = []
    for res in d:
        h = res.handle
        x, scales = res.x.copy(), res.x_scales.copy()
        src_info, layout_range = h.src_info.copy(), h.layout_range.copy()
        begin, count = ref.unpack_layout_range(h.layout_range)
        for e in range(h.num_local_experts):
            start = 0
            for s in rng.permutation(num_ranks):
                rows = int(begin[e, s]) + rng.permutation(int(count[e, s]))
                new = slice(start, start + len(rows))
                x[e, new], scales[e, new], src_info[e, new] = res.x[e, rows], res.x_scales[e, rows], h.src_info[e, rows]
                layout_range[e, s] = ref.pack_layout_range(start, len(rows))
                start += len(rows)
        handle = ref.LowLatencyHandle(
            src_info, layout_range, h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts
        )
        shuffled.append(ref.LowLatencyDispatchResult(x, scales, res.recv_count, handle))
    assert any(not np.array_equal(a.src_info, b.src_info) for a, b in zip(d, shuffled, strict=True))
    ys = expert_outputs(d, num_experts)
    ys_shuffled = expert_outputs(shuffled, num_experts)
    # Dequantised FP8 of expert 0 is enough to feed the combine; build bf16 ys from the FP8 rows.
    deq = [ref.fp8_to_float(r.x, r.x_scales).astype(BF16) for r in d]
    deq_shuffled = [ref.fp8_to_float(r.x, r.x_scales).astype(BF16) for r in shuffled]
    for y_a, y_b in ((deq, deq_shuffled), (ys, ys_shuffled)):
        out_a = ref.low_latency_combine(y_a, idx, w, [r.handle for r in d])
        out_b = ref.low_latency_combine(y_b, idx, w, [r.handle for r in shuffled])
        for a, b in zip(out_a, out_b, strict=True):
            assert np.array_equal(bits(a.x), bits(b.x))
    for a, b in zip(d, shuffled, strict=True):
        s = ref.sort_low_latency_result(b)
        np.testing.assert_array_equal(s.x, a.x)
        np.testing.assert_array_equal(s.x_scales.view(np.uint32), a.x_scales.view(np.uint32))
        np.testing.assert_array_equal(s.src_info, a.src_info)
        np.testing.assert_array_equal(s.layout_range, a.layout_range)


def test_low_latency_combine_rejects_foreign_handle():
    d = ref.low_latency_dispatch(LL_X, LL_IDX, 3, 4, use_fp8=False)
    other = [np.array([[0, 3], [-1, 1], [1, -1]]), LL_IDX[1]]
    ys = [r.x for r in d]
    with pytest.raises(ArgumentError, match="another routing"):
        ref.low_latency_combine(ys, other, LL_W, [r.handle for r in d])


def test_low_latency_limits():
    xs = [bf16(np.ones((3, 128))), bf16(np.ones((1, 128)))]
    idx = [np.array([[0], [1], [2]]), np.array([[3]])]
    with pytest.raises(ArgumentError, match=r"xs\[0\] has 3 tokens but num_max_dispatch_tokens_per_rank=2"):
        ref.low_latency_dispatch(xs, idx, 2, 4)
    # A repeated expert sends one row per slot: two tokens x two slots overflow a 3-row receive slot.
    idx = [np.array([[0, 0], [0, 0], [1, 2]]), np.array([[3, 3]])]
    with pytest.raises(ArgumentError, match="sends 4 slots to expert 0"):
        ref.low_latency_dispatch(xs, idx, 3, 4)
    with pytest.raises(ArgumentError, match="use_fp8=True"):
        ref.low_latency_dispatch(
            xs, [np.array([[0], [1], [2]]), np.array([[3]])], 3, 4, use_fp8=False, round_scale=True
        )
    with pytest.raises(ArgumentError, match="hidden=64"):
        ref.low_latency_dispatch([bf16(np.ones((1, 64)))] * 2, [np.array([[0]])] * 2, 3, 4)


# ----------------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------------


def test_validation_topk_idx_range():
    idx = [HAND_IDX[0], np.array([[0, 300]])]
    xs = [HAND_X[0], bf16([[1, 2]])]
    with pytest.raises(ArgumentError, match=r"topk_idx\[1\] has values in \[0, 300\] but must lie in \[-1, 4\)"):
        ref.dispatch(xs, idx, None, 4)
    with pytest.raises(ArgumentError, match=r"values in \[-2, 1\]"):
        ref.get_dispatch_layout(np.array([[-2, 1]]), 4, 2)
    with pytest.raises(ArgumentTypeError, match="integer"):
        ref.get_dispatch_layout(np.array([[0.0, 1.0]]), 4, 2)


def test_validation_shapes_and_dtypes():
    with pytest.raises(ArgumentError, match=r"xs\[1\] has hidden=3 but xs\[0\] has hidden=2"):
        ref.dispatch([HAND_X[0], bf16(np.zeros((0, 3)))], HAND_IDX, None, 4)
    with pytest.raises(ArgumentTypeError, match=r"xs\[0\] must be bfloat16"):
        ref.dispatch([HAND_X[0].astype(np.float32), HAND_X[1]], HAND_IDX, None, 4)
    with pytest.raises(ArgumentTypeError, match=r"xs\[0\] is FP8"):
        ref.dispatch([np.zeros((3, 128), np.uint8), np.zeros((0, 128), np.uint8)], HAND_IDX, None, 4)
    with pytest.raises(ArgumentError, match=r"topk_idx\[0\] has 3 rows but the rank has 2 tokens"):
        ref.dispatch([HAND_X[0][:2], HAND_X[1]], HAND_IDX, None, 4)
    with pytest.raises(ArgumentError, match=r"topk_idx\[1\] has num_topk=3"):
        ref.dispatch(HAND_X, [HAND_IDX[0], np.zeros((0, 3), np.int64)], None, 4)
    with pytest.raises(ArgumentError, match=r"topk_weights\[0\] has shape \(3, 1\)"):
        ref.dispatch(HAND_X, HAND_IDX, [HAND_W[0][:, :1], HAND_W[1]], 4)
    with pytest.raises(ArgumentError, match="num_experts=5 must be a positive multiple of num_ranks=2"):
        ref.dispatch(HAND_X, HAND_IDX, None, 5)
    with pytest.raises(ArgumentError, match="topk_idx has 1 entries but there are 2 ranks"):
        ref.dispatch(HAND_X, HAND_IDX[:1], None, 4)
    with pytest.raises(ArgumentTypeError, match="one entry per rank"):
        ref.dispatch(HAND_X[0], HAND_IDX, None, 4)
    with pytest.raises(ArgumentError, match="expert_alignment must be an int >= 1, got 0"):
        ref.dispatch(HAND_X, HAND_IDX, None, 4, expert_alignment=0)
    q = [np.zeros((3, 100), np.uint8), np.zeros((0, 100), np.uint8)]
    with pytest.raises(ArgumentError, match="hidden=100, which must be a multiple of 128"):
        ref.dispatch(q, HAND_IDX, None, 4, x_scales=[np.zeros((3, 1), np.float32), np.zeros((0, 1), np.float32)])
    q = [np.zeros((3, 128), np.uint8), np.zeros((0, 128), np.uint8)]
    with pytest.raises(ArgumentError, match=r"x_scales\[0\] has shape \(3, 2\)"):
        ref.dispatch(q, HAND_IDX, None, 4, x_scales=[np.zeros((3, 2), np.float32), np.zeros((0, 1), np.float32)])


def test_validation_numbers():
    """A count that is not an integer is refused naming it; a NumPy integer counts as the int it is."""
    for call, message in (
        (lambda: ref.dispatch(HAND_X, HAND_IDX, None, "4"), "num_experts must be an int, got '4'"),
        (lambda: ref.dispatch(HAND_X, HAND_IDX, None, 4.0), "num_experts must be an int, got 4.0"),
        (lambda: ref.dispatch(HAND_X, HAND_IDX, None, 4, num_worst_tokens=8.0),
         "num_worst_tokens must be an int >= 0, got 8.0"),
        (lambda: ref.dispatch(HAND_X, HAND_IDX, None, 4, expert_alignment="2"),
         "expert_alignment must be an int >= 1, got '2'"),
        (lambda: ref.rank_of_expert(1.5, 8, 4), "expert must be an int, got 1.5"),
        (lambda: ref.rank_of_expert(1, 8, "4"), "num_ranks must be an int >= 1, got '4'"),
        (lambda: ref.get_dispatch_layout(HAND_IDX[0], 4, 2, num_nvl_ranks=1.0),
         "num_nvl_ranks must be an int, got 1.0"),
        (lambda: ref.low_latency_dispatch(LL_X, LL_IDX, 3.0, 4),
         "num_max_dispatch_tokens_per_rank must be an int >= 1, got 3.0"),
        (lambda: ref.low_latency_dispatch(LL_X, LL_IDX, 3, 4, use_fp8="False"),
         "use_fp8 must be True or False, got 'False'"),
        (lambda: ref.per_token_cast_to_fp8(np.ones((1, 128), np.float32), use_ue8m0="no"),
         "use_ue8m0 must be True or False, got 'no'"),
        (lambda: ref.pack_layout_range(3.7, 2), "begin must be an int or an integer array, got 3.7"),
        (lambda: ref.pack_layout_range(3, np.array(["2"])),
         "count must be an int or an integer array, got an array of <U1"),
    ):
        with pytest.raises(ArgumentTypeError) as e:
            call()
        assert str(e.value) == message
    assert ref.rank_of_expert(np.int64(5), np.array(8), np.int32(4)) == 2
    layout = ref.get_dispatch_layout(HAND_IDX[0], np.int64(4), np.int64(2))
    assert layout.num_tokens_per_expert.shape == (4,)
    assert int(ref.pack_layout_range(np.int32(3), np.array([2]))[0]) == 3 << 32 | 2


def test_validation_combine():
    d = ref.dispatch(HAND_X, HAND_IDX, HAND_W, 4)
    handles = [r.handle for r in d]
    with pytest.raises(ArgumentError, match=r"ys\[1\] has shape \(3, 2\) but rank 1 received 2 rows"):
        ref.combine([d[0].x, bf16(np.zeros((3, 2)))], handles)
    with pytest.raises(ArgumentTypeError, match=r"ys\[0\] must be bfloat16"):
        ref.combine([d[0].x.astype(np.float32), d[1].x], handles)
    other = ref.dispatch(HAND_X, [np.array([[0, 1], [-1, 1], [2, -1]]), HAND_IDX[1]], None, 4)
    with pytest.raises(ArgumentError, match="different routings"):
        ref.combine([d[0].x, other[1].x], [handles[0], other[1].handle])
    with pytest.raises(ArgumentError, match=r"bias\[0\] term 0 has shape \(2, 2\)"):
        ref.combine([r.x for r in d], handles, bias=[bf16(np.zeros((2, 2))), bf16(np.zeros((0, 2)))])



def test_validation_combine_num_nvl_ranks():
    d = ref.dispatch(NODE_X, NODE_IDX, None, 4)
    handles = [r.handle for r in d]
    for nvl in (3, 0, -2, 8):
        with pytest.raises(ArgumentError) as e:
            ref.combine(NODE_YS, handles, num_nvl_ranks=nvl)
        assert str(e.value) == f"num_nvl_ranks={nvl} must be >= 1 and divide num_ranks=4"
    for nvl in (2.0, "2", True):
        with pytest.raises(ArgumentTypeError) as e:
            ref.combine(NODE_YS, handles, num_nvl_ranks=nvl)
        assert str(e.value) == f"num_nvl_ranks must be an int, got {nvl!r}"


def test_calc_diff():
    x = np.random.default_rng(0).standard_normal((8, 16))
    assert abs(ref.calc_diff(x, x)) < 1e-15
    assert ref.calc_diff(np.zeros(4), np.zeros(4)) == 0.0
    # DeepEP shifts by 1: a = 1, b = 2 -> 1 - 2*2/(1 + 4) = 0.2.
    assert ref.calc_diff(np.zeros(1), np.ones(1)) == pytest.approx(0.2, abs=1e-15)
    assert ref.calc_diff(bf16(x), x) < 1e-4
    assert np.isnan(ref.calc_diff(np.array([np.nan]), np.zeros(1)))
    with pytest.raises(ArgumentError, match="equal shapes"):
        ref.calc_diff(np.zeros(2), np.zeros(3))
