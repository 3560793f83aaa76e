"""CPU tier of the FP8 normal combine (``Buffer.combine(..., use_fp8=True)``): the reference's semantics over
simulated ranks, and what the Buffer's front refuses before any plan or kernel. The GPU kernel is held bit for bit
to the reference by tests/ranks/intranode.py (tests/test_gpu_intranode.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from epjit import ArgumentError, ArgumentTypeError, Buffer
from epjit import reference as ref
from epjit.front.common import Plans
from epjit.front.normal import InternodeFront, IntranodeFront
from epjit.ops.normal import DispatchHandle

from .test_reference import BF16, bf16, bits, random_routing


def _dequantised(y: np.ndarray) -> np.ndarray:
    return ref.fp8_to_float(*ref.per_token_cast_to_fp8(y))


def _fp8_by_hand(ys, handles, biases):
    """The documented formula, spelt out: per token, bias first, then each rank's row's FP8 round trip, in rank
    order, in float32; bf16 once at the end."""
    out = []
    for s in range(len(biases)):
        acc = biases[s].astype(np.float32).copy()
        for r, h in enumerate(handles):
            for row in np.flatnonzero(h.src_rank == s):
                acc[h.src_token[row]] += _dequantised(ys[r][row:row + 1])[0]
        out.append(acc.astype(BF16))
    return out


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_fp8_combine_sums_each_rows_round_trip_in_rank_order(num_ranks):
    rng = np.random.default_rng(50 + num_ranks)
    num_experts, hidden = 4 * num_ranks, 256
    xs, idx, w = random_routing(rng, num_ranks, num_experts, 3, hidden)
    d = ref.dispatch(xs, idx, w, num_experts)
    handles = [r.handle for r in d]
    ys = [bf16(rng.standard_normal(r.x.shape) * 10.0 ** rng.integers(-3, 3, size=(r.x.shape[0], 1))) for r in d]
    biases = [bf16(rng.standard_normal(x.shape)) for x in xs]
    c = ref.combine(ys, handles, topk_weights=[r.topk_weights for r in d], bias=biases, use_fp8=True)
    plain = ref.combine(ys, handles, topk_weights=[r.topk_weights for r in d], bias=biases)
    want = _fp8_by_hand(ys, handles, biases)
    for s in range(num_ranks):
        np.testing.assert_array_equal(bits(c[s].x), bits(want[s]))
        np.testing.assert_array_equal(c[s].topk_weights, plain[s].topk_weights)  # weights are never quantised


def test_fp8_combine_of_rows_fp8_holds_exactly_is_the_bf16_combine():
    """Rows whose every 128 channels are e4m3 values times 2**k with one at +-448 * 2**k: the scale is 2**k and the
    round trip exact, so the FP8 combine is the bf16 combine bit for bit."""
    rng = np.random.default_rng(7)
    e4m3 = np.unique(ref.fp8_bits_to_float32(np.arange(256, dtype=np.uint8)))
    e4m3 = e4m3[np.isfinite(e4m3)]
    xs, idx, w = random_routing(rng, 4, 16, 4, 512)
    d = ref.dispatch(xs, idx, w, 16)
    ys = []
    for r in d:
        blocks = rng.choice(e4m3, size=(r.x.shape[0], 4, 128))
        blocks[:, :, 0] = 448.0 * rng.choice([-1.0, 1.0], size=(r.x.shape[0], 4))
        ys.append(bf16((blocks * 2.0 ** rng.integers(-6, 4, size=(r.x.shape[0], 4, 1))).reshape(-1, 512)))
    handles = [r.handle for r in d]
    for fp8, plain in zip(ref.combine(ys, handles, use_fp8=True), ref.combine(ys, handles), strict=True):
        np.testing.assert_array_equal(bits(fp8.x), bits(plain.x))


def test_fp8_combine_error_against_bf16():
    """What e4m3 costs (3 mantissa bits: at most 2**-4 relative a value): DeepEP's calc_diff against the bf16
    combine is about 2.6e-4 on normal rows, and no value moves by more than 2**-4 of its token's largest."""
    rng = np.random.default_rng(3)
    xs, idx, w = random_routing(rng, 4, 32, 8, 1024, token_counts=[64, 64, 64, 64], hole_prob=0.0)
    d = ref.dispatch(xs, idx, w, 32)
    ys = [bf16(rng.standard_normal(r.x.shape)) for r in d]
    handles = [r.handle for r in d]
    for fp8, plain in zip(ref.combine(ys, handles, use_fp8=True), ref.combine(ys, handles), strict=True):
        a, b = fp8.x.astype(np.float32), plain.x.astype(np.float32)
        assert 0 < ref.calc_diff(a, b) < 1e-3
        assert np.all(np.abs(a - b) <= 2**-4 * np.abs(b).max(axis=1, keepdims=True) + 1e-6)


def test_fp8_combine_ignores_padding_rows():
    d = ref.dispatch([bf16(np.ones((3, 128))), bf16(np.zeros((0, 128)))],
                     [np.array([[0], [1], [2]]), np.zeros((0, 1), np.int64)], None, 4, num_worst_tokens=4)
    ys = [np.concatenate([d[0].x[:2], bf16(np.full((2, 128), np.nan))]),
          np.concatenate([d[1].x[:1], bf16(np.full((3, 128), np.inf))])]
    c = ref.combine(ys, [r.handle for r in d], use_fp8=True)
    np.testing.assert_array_equal(bits(c[0].x), bits(bf16(np.ones((3, 128)))))  # 1 = 448 x (1 / 448): exact


def test_reference_fp8_combine_refusals():
    d = ref.dispatch([bf16(np.ones((2, 64)))] * 2, [np.array([[0], [1]])] * 2, None, 2)
    handles, ys = [r.handle for r in d], [r.x for r in d]
    with pytest.raises(ArgumentError, match="ys has hidden=64, which must be a multiple of 128 for FP8"):
        ref.combine(ys, handles, use_fp8=True)
    with pytest.raises(ArgumentTypeError, match="use_fp8 must be True or False, got 'yes'"):
        ref.combine(ys, handles, use_fp8="yes")
    d = ref.dispatch([bf16(np.ones((2, 64)))] * 4, [np.array([[0], [3]])] * 4, None, 4)
    with pytest.raises(ArgumentError, match="ys has hidden=64, which must be a multiple of 128 for FP8"):
        ref.combine([r.x for r in d], [r.handle for r in d], num_nvl_ranks=2, use_fp8=True)


# ------------------------------------------------------------------------------------------------- across nodes


def _fp8_two_level_by_hand(ys, handles, biases, nvl):
    """The documented formula across nodes, spelt out: per token, bias first, then each node's float32 partial (its
    ranks' bf16 rows in order) through its FP8 round trip, the nodes in order; bf16 once at the end."""
    out = []
    for s in range(len(biases)):
        acc = biases[s].astype(np.float32).copy()
        for t in range(acc.shape[0]):
            for m in range(len(handles) // nvl):
                rows = [ys[r][np.flatnonzero((h.src_rank == s) & (h.src_token == t))[0]].astype(np.float32)
                        for r, h in enumerate(handles[m * nvl:(m + 1) * nvl], start=m * nvl)
                        if np.any((h.src_rank == s) & (h.src_token == t))]
                if rows:
                    partial = np.zeros(acc.shape[1], np.float32)
                    for row in rows:
                        partial = partial + row
                    acc[t] += _dequantised(partial[None])[0]
        out.append(acc.astype(BF16))
    return out


def _two_level_case(seed, num_ranks, hidden=256):
    rng = np.random.default_rng(seed)
    xs, idx, w = random_routing(rng, num_ranks, 4 * num_ranks, 3, hidden)
    d = ref.dispatch(xs, idx, w, 4 * num_ranks)
    ys = [bf16(rng.standard_normal(r.x.shape) * 10.0 ** rng.integers(-3, 3, size=(r.x.shape[0], 1))) for r in d]
    biases = [bf16(rng.standard_normal(x.shape)) for x in xs]
    return d, [r.handle for r in d], ys, biases


@pytest.mark.parametrize(("num_ranks", "nvl"), [(4, 2), (8, 2), (8, 4)])
def test_fp8_combine_across_nodes_quantises_each_nodes_float32_partial(num_ranks, nvl):
    d, handles, ys, biases = _two_level_case(60 + num_ranks + nvl, num_ranks)
    weights = [r.topk_weights for r in d]
    c = ref.combine(ys, handles, topk_weights=weights, bias=biases, num_nvl_ranks=nvl, use_fp8=True)
    plain = ref.combine(ys, handles, topk_weights=weights, bias=biases, num_nvl_ranks=nvl)
    want = _fp8_two_level_by_hand(ys, handles, biases, nvl)
    for s in range(num_ranks):
        np.testing.assert_array_equal(bits(c[s].x), bits(want[s]))
        np.testing.assert_array_equal(c[s].topk_weights, plain[s].topk_weights)  # weights are never quantised


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_fp8_combine_of_one_rank_nodes_is_the_one_node_fp8_combine(num_ranks):
    """V = 1: a node's partial is one bf16 row, so its round trip is that row's: the same bits as inside one node."""
    d, handles, ys, biases = _two_level_case(70 + num_ranks, num_ranks)
    one = ref.combine(ys, handles, bias=biases, use_fp8=True)
    for a, b in zip(one, ref.combine(ys, handles, bias=biases, num_nvl_ranks=1, use_fp8=True), strict=True):
        np.testing.assert_array_equal(bits(a.x), bits(b.x))


def test_fp8_combine_across_nodes_error_against_bf16():
    """One quantisation a node's partial: calc_diff against the bf16 two-level combine about 2.6e-4 on normal rows,
    and no value moves by more than 2**-4 of its token's largest partial times the nodes."""
    rng = np.random.default_rng(4)
    xs, idx, w = random_routing(rng, 8, 32, 8, 1024, token_counts=[64] * 8, hole_prob=0.0)
    d = ref.dispatch(xs, idx, w, 32)
    ys = [bf16(rng.standard_normal(r.x.shape)) for r in d]
    handles = [r.handle for r in d]
    fp8 = ref.combine(ys, handles, num_nvl_ranks=2, use_fp8=True)
    plain = ref.combine(ys, handles, num_nvl_ranks=2)
    for a8, b16 in zip(fp8, plain, strict=True):
        a, b = a8.x.astype(np.float32), b16.x.astype(np.float32)
        assert 0 < ref.calc_diff(a, b) < 1e-3
        assert np.all(np.abs(a - b) <= 4 * 2**-4 * (np.abs(b).max(axis=1, keepdims=True) + 8))


# ---------------------------------------------------------------------------------------------------- the front


class _Looked(Exception):
    pass


class _StopAtLookup(dict):
    def get(self, key, default=None):
        raise _Looked(key)


def _front(cls: type = IntranodeFront, num_ranks: int = 2, num_nvl_ranks: int = 2, plans: dict | None = None):
    """A normal-mode front with nothing behind it (no GPU): a call reaches its checks and its plan look-up only."""
    front = object.__new__(cls)
    front.res, front.device, front.buffer_id = SimpleNamespace(), 0, 1
    front.plans = _StopAtLookup() if plans is None else plans
    front.num_ranks, front.num_nvl_ranks, front.num_experts = num_ranks, num_nvl_ranks, 64
    front.ops = SimpleNamespace(check_pending=lambda capturing: None)
    return front


def _handle(hidden: int) -> DispatchHandle:
    plan = SimpleNamespace(num_tokens=4, hidden=hidden, num_topk=2, num_channels=24, num_experts=64)
    return DispatchHandle((), 0, None, 4, 4, plan, 1)  # type: ignore[arg-type]


def _combine(front, hidden: int = 256, **kwargs):
    return front.combine(None, _handle(hidden), None, None, None, None, False, **kwargs)


def test_buffer_combine_takes_use_fp8_by_keyword_only():
    import inspect

    param = inspect.signature(Buffer.combine).parameters["use_fp8"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is False


def test_front_keys_an_fp8_combine_apart_and_a_bf16_one_as_before():
    with pytest.raises(_Looked) as plain:
        _combine(_front())
    for value in (True, np.True_, 1):
        with pytest.raises(_Looked) as fp8:
            _combine(_front(), use_fp8=value)
        assert fp8.value.args[0] == (*plain.value.args[0], "fp8")
    for value in (False, np.False_, 0):
        with pytest.raises(_Looked) as same:
            _combine(_front(), use_fp8=value)
        assert same.value.args[0] == plain.value.args[0]


@pytest.mark.parametrize("value", ["True", None, 2, np.array([True, False])], ids=repr)
def test_front_refuses_use_fp8_that_is_not_a_flag(value):
    with pytest.raises(ArgumentTypeError, match=r"^use_fp8 must be True or False, got "):
        _combine(_front(), use_fp8=value)


def test_front_refuses_fp8_combine_of_hidden_not_a_multiple_of_128():
    with pytest.raises(ArgumentError) as e:
        _combine(_front(plans=Plans()), hidden=200, use_fp8=True)
    assert str(e.value) == ("combine with use_fp8=True needs hidden % 128 == 0 (a scale a 128 channels), but the "
                            "dispatch's hidden is 200")


def test_front_keys_an_fp8_combine_across_nodes_apart():
    with pytest.raises(_Looked) as plain:
        _combine(_front(InternodeFront, 4, 2))
    with pytest.raises(_Looked) as fp8:
        _combine(_front(InternodeFront, 4, 2), use_fp8=True)
    assert fp8.value.args[0] == (*plain.value.args[0], "fp8")


def test_front_refuses_fp8_combine_across_nodes_of_hidden_not_a_multiple_of_128():
    with pytest.raises(ArgumentError, match="use_fp8=True needs hidden % 128 == 0 .* hidden is 200"):
        _combine(_front(InternodeFront, 4, 2, plans=Plans()), hidden=200, use_fp8=True)


def test_internode_fp8_spec_is_the_combines_roles_in_both_builds():
    from epjit.kernels import internode as k

    spec = k.internode_spec(2, 4)
    fp8 = k.internode_combine_fp8_spec(spec)
    assert type(fp8) is k.InternodeCombineFp8Spec and fp8.USES_NVSHMEM and not fp8.DEFINES
    assert (fp8.num_nodes, fp8.num_nvl_ranks, fp8.num_threads, fp8.combine_send_warps,
            fp8.combine_forward_groups) == (2, 4, spec.num_threads, spec.combine_send_warps,
                                            spec.combine_forward_groups)
    stores = k.by_stores(fp8)
    assert type(stores) is k.InternodeCombineFp8StoresSpec and stores.DEFINES == ("EPJIT_RDMA_BY_STORES",)
    assert not stores.USES_NVSHMEM and k.internode_combine_fp8_spec(k.by_stores(spec)) == stores
    assert k.by_stores(stores) == stores and type(k.by_stores(spec)) is k.InternodeStoresSpec
    # the bf16 combine's arguments, so one plan builder serves both
    assert fp8.KERNELS == {"internode_combine_fp8": k.InternodeSpec.KERNELS["internode_combine"]}
    roles = f"{spec.combine_send_warps}, {spec.combine_forward_groups}"
    assert fp8.name_expression("internode_combine_fp8") == f"epjit::internode_combine_fp8<2, 4, 768, {roles}>"


def test_the_fast_round_trip_is_the_float8_casts_bit_for_bit():
    """The combine's reference rounds through e4m3 in float32 arithmetic (numerics.fp8_round_trip): every e4m3
    value, every midpoint between two (ties to even) and its float32 neighbours, and random rows of every scale give
    the bits ml_dtypes' float8 casts give."""
    import ml_dtypes

    from epjit.reference.numerics import e4m3_nearest, fp8_round_trip, fp8_to_float, per_token_cast_to_fp8

    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    e4m3 = np.sort(e4m3[np.isfinite(e4m3)])
    mids = (e4m3[:-1] + e4m3[1:]) / 2
    rng = np.random.default_rng(3)
    values = np.concatenate([e4m3, mids, np.nextafter(mids, np.float32(np.inf)),
                             np.nextafter(mids, np.float32(-np.inf)),
                             rng.uniform(-448, 448, 100_000).astype(np.float32),
                             (rng.standard_normal(100_000) * 0.01).astype(np.float32)]).astype(np.float32)
    values = np.clip(values, -448, 448)
    want = values.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(e4m3_nearest(values).view(np.uint32), want.view(np.uint32))
    for scale in (1e-6, 1.0, 3e4):
        x = (rng.standard_normal((64, 1024)) * scale).astype(ml_dtypes.bfloat16)
        x[0, :128] = 0  # a block of zeros: the amax floor
        slow = fp8_to_float(*per_token_cast_to_fp8(x))
        assert np.array_equal(fp8_round_trip(x).view(np.uint32), slow.view(np.uint32)), scale


def _rn32(n: int, e: int) -> np.float32:
    """n * 2**e (n an int) rounded to the nearest float32, ties to even (normal results only, as here)."""
    sign, n = (-1 if n < 0 else 1), abs(n)
    shift = n.bit_length() - 24
    if shift > 0:
        n, rest = divmod(n, 1 << shift)
        half = 1 << (shift - 1)
        n += rest > half or (rest == half and n & 1)
        e += shift
    return np.float32(math.ldexp(sign * n, e))


def _exact(v: np.float32) -> tuple[int, int]:
    n, d = float(v).as_integer_ratio()
    return n, -(d.bit_length() - 1)


def _fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """A float32 fused multiply-add: a * b + c exactly, rounded once."""
    (na, ea), (nb, eb), (nc, ec) = _exact(a), _exact(b), _exact(c)
    e = min(ea + eb, ec)
    return _rn32((na * nb << (ea + eb - e)) + (nc << (ec - e)), e)


def test_the_fp8_scale_without_division_is_the_ieee_division_for_every_bf16_amax():
    """cuda_src/fp8.cuh bf16_block_scale: for every amax a block of bf16 values can have (every positive finite bf16
    at or above the 1e-4 floor, and the floor), amax * RN(1/448) corrected once by its FMA residual is amax / 448
    (float32 division, the reference's scale), and its reciprocal from rcp.approx (any start within 2 ulp) corrected
    by one Newton step in FMAs is 1 / scale (the reference's inverse), bit for bit."""
    bf16_bits = np.arange(0, 0x7F80, dtype=np.uint32) << 16
    amaxes = np.unique(np.maximum(bf16_bits.view(np.float32), np.float32(1e-4)))
    max_, inverse_max, one = np.float32(448), np.float32(1) / np.float32(448), np.float32(1)
    for amax in amaxes:
        want = amax / max_
        guess = amax * inverse_max  # (NumPy's float32 multiply: one rounding)
        scale = _fma32(_fma32(-guess, max_, amax), inverse_max, guess)
        assert scale == want, (amax, scale, want)
        want_inverse = one / scale
        for ulps in (-2, -1, 0, 1, 2):
            start = want_inverse.view(np.int32) + np.int32(ulps)
            start = start.view(np.float32)
            assert _fma32(_fma32(-scale, start, one), start, start) == want_inverse, (amax, ulps)
