"""The reference takes what the GPU API takes: NumPy, PyTorch (bf16 and FP8 included), JAX and CuPy arrays, or any
DLPack producer, copied to the host first; and every operation returns one record per rank with its tokens in
``.x``. Each framework's case gives the same results, bit for bit, as the NumPy inputs; the torch, JAX and CuPy
cases skip, saying so, where that framework (or, for CuPy, a GPU) is missing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from epjit import reference as ref
from epjit.errors import ArgumentTypeError

NUM_RANKS, NUM_EXPERTS, HIDDEN, TOPK, MAX_TOKENS = 2, 8, 256, 3, 16


def _case() -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Every rank's bf16 tokens, int64 top-k ids (with -1 holes) and float32 weights."""
    rng = np.random.default_rng(7)
    xs, idxs, ws = [], [], []
    for n in (5, 11):
        xs.append(rng.standard_normal((n, HIDDEN), dtype=np.float32).astype(ref.BF16))
        idx = np.argsort(rng.random((n, NUM_EXPERTS)), axis=1)[:, :TOPK].astype(np.int64)
        idx[rng.random(idx.shape) < 0.2] = -1
        idxs.append(idx)
        ws.append(rng.random((n, TOPK), dtype=np.float32))
    return xs, idxs, ws


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype == ref.BF16 else a


def _same(got: np.ndarray | None, want: np.ndarray | None) -> None:
    assert (got is None) == (want is None)
    if got is not None and want is not None:
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_array_equal(_bits(got), _bits(want))


def _every_operation(convert: Callable[[np.ndarray], Any]) -> dict[str, list[np.ndarray | None]]:
    """Every operation's outputs with the case's inputs passed through ``convert``."""
    xs, idxs, ws = _case()
    cx, cidx, cw = ([convert(a) for a in arrays] for arrays in (xs, idxs, ws))
    out: dict[str, list[np.ndarray | None]] = {}
    out["layout"] = [ref.get_dispatch_layout(cidx[0], NUM_EXPERTS, NUM_RANKS).num_tokens_per_expert]
    d = ref.dispatch(cx, cidx, cw, NUM_EXPERTS)
    out["dispatch"] = [a for r in d for a in (r.x, r.topk_idx, r.topk_weights)]
    c = ref.combine([convert(r.x) for r in d], [r.handle for r in d], topk_weights=[convert(r.topk_weights) for r in d])
    out["combine"] = [a for r in c for a in (r.x, r.topk_weights)]
    q, scales = ref.per_token_cast_to_fp8(cx[0])
    out["fp8"] = [q, scales, ref.fp8_to_float(convert(q), convert(scales))]
    fp8 = [ref.per_token_cast_to_fp8(x) for x in xs]
    d8 = ref.dispatch([convert(ref.fp8_bits_as_float8(b)) for b, _ in fp8], cidx, None, NUM_EXPERTS,
                      x_scales=[convert(s) for _, s in fp8])
    out["dispatch_fp8"] = [a for r in d8 for a in (r.x, r.x_scales)]
    ll = ref.low_latency_dispatch(cx, cidx, MAX_TOKENS, NUM_EXPERTS, use_fp8=False)
    out["low_latency_dispatch"] = [a for r in ll for a in (r.x, r.recv_count)]
    lc = ref.low_latency_combine([convert(r.x) for r in ll], cidx, cw, [r.handle for r in ll])
    out["low_latency_combine"] = [r.x for r in lc]
    out["calc_diff"] = [np.array(ref.calc_diff(cx[0], cx[1][:5]))]
    return out


def _check_like_numpy(convert: Callable[[np.ndarray], Any]) -> None:
    want = _every_operation(lambda a: a)
    got = _every_operation(convert)
    assert got.keys() == want.keys()
    for name in want:
        assert len(got[name]) == len(want[name]), name
        for g, w in zip(got[name], want[name], strict=True):
            _same(g, w)


def test_every_operation_returns_one_record_per_rank_with_x():
    xs, idxs, ws = _case()
    d = ref.dispatch(xs, idxs, ws, NUM_EXPERTS)
    c = ref.combine([r.x for r in d], [r.handle for r in d])
    ll = ref.low_latency_dispatch(xs, idxs, MAX_TOKENS, NUM_EXPERTS)
    lc = ref.low_latency_combine([ref.fp8_to_float(r.x, r.x_scales).astype(ref.BF16) for r in ll], idxs, ws,
                                 [r.handle for r in ll])
    for results, record in ((d, ref.DispatchResult), (c, ref.CombineResult), (ll, ref.LowLatencyDispatchResult),
                            (lc, ref.LowLatencyCombineResult)):
        assert len(results) == NUM_RANKS and all(isinstance(r, record) for r in results)
        assert all(isinstance(r.x, np.ndarray) for r in results)
    assert [r.x.shape for r in c] == [r.x.shape for r in lc] == [x.shape for x in xs]


class _DLPackOnly:
    """An array of some other framework: DLPack and nothing else (no ``__array__``)."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()


def test_dlpack_producers_give_the_numpy_results():
    # NumPy's DLPack knows no bf16 or FP8: pass those as NumPy and the rest (indices, weights, scales) by DLPack.
    _check_like_numpy(lambda a: a if a.dtype in (ref.BF16, ref.FP8) else _DLPackOnly(a))


def test_torch_inputs_give_the_numpy_results():
    torch = pytest.importorskip("torch", reason="torch is not installed: the torch inputs are not tested here")

    def to_torch(a: np.ndarray) -> Any:
        if a.dtype == ref.BF16:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        if a.dtype == ref.FP8:
            return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        return torch.from_numpy(a.copy()).requires_grad_(a.dtype == np.float32)  # detached on the way

    _check_like_numpy(to_torch)


def test_torch_bf16_tensor_is_taken_as_bf16_bits():
    torch = pytest.importorskip("torch", reason="torch is not installed: the torch inputs are not tested here")
    x = torch.randn(4, 128).to(torch.bfloat16)
    q, scales = ref.per_token_cast_to_fp8(x)
    want = ref.per_token_cast_to_fp8(x.view(torch.int16).numpy().view(ref.BF16))
    np.testing.assert_array_equal(q, want[0])
    np.testing.assert_array_equal(scales, want[1])
    with pytest.raises(ArgumentTypeError, match=r"xs\[0\] must be bfloat16 \(ml_dtypes.bfloat16\), got float32"):
        ref.low_latency_dispatch([x.float()], [torch.zeros(4, 1, dtype=torch.int64)], 4, 2)


def test_jax_inputs_give_the_numpy_results():
    jnp = pytest.importorskip("jax.numpy", reason="JAX is not installed: the JAX inputs are not tested here")
    # Without jax_enable_x64 JAX stores int64 as int32: the reference gives int64 back all the same.
    _check_like_numpy(lambda a: jnp.asarray(a))


def test_cupy_inputs_give_the_numpy_results():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed: the CuPy inputs are not tested here")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        pytest.skip(f"CuPy has no GPU here ({e}): the CuPy inputs are not tested here")
    # CuPy has no bf16 or FP8 dtype: those stay NumPy, the rest goes through the GPU.
    _check_like_numpy(lambda a: a if a.dtype in (ref.BF16, ref.FP8) else cupy.asarray(a))
