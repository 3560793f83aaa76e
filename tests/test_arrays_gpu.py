"""GPU tier for epjit.arrays: torch, JAX and CuPy arrays into CuPy and back with no copies.

Each test skips (with the reason) when its framework is missing or there is no GPU. Run on a GPU machine with
`pytest -m gpu tests/test_arrays_gpu.py`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from epjit import arrays
from epjit.arrays import check, describe, from_cupy, to_cupy
from epjit.errors import ArgumentError, ArgumentTypeError

pytestmark = pytest.mark.gpu

# JAX grabs 75% of GPU memory when its GPU client starts; torch and CuPy share the GPU in these tests.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

DTYPES = ["bfloat16", "float32", "int64", "bool", "float8_e4m3fn"]
SHAPE = (37, 64)  # odd row count, 64 columns: no accidental power-of-two alignment of the whole array


# --------------------------------------------------------------------------------------------------------------------
# Skips


def _cupy() -> Any:
    cp = pytest.importorskip("cupy")
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except RuntimeError as exc:  # CUDARuntimeError: no driver or no device
        pytest.skip(f"CuPy cannot reach a GPU: {exc}")
    if count == 0:
        pytest.skip("no CUDA device")
    return cp


def _torch() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch


def _jax() -> tuple[Any, Any]:
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"JAX has no GPU backend: {exc}")
    if not gpus:
        pytest.skip("JAX sees no GPU")
    return jax, gpus[0]


@contextlib.contextmanager
def _x64(jax: Any, on: bool) -> Iterator[None]:
    """int64 exists in JAX only with jax_enable_x64; switch it on for one test and restore it."""
    if not on:
        yield
        return
    old = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


# --------------------------------------------------------------------------------------------------------------------
# Values and bytes


def _values(dtype: str) -> np.ndarray:
    """Random, non-zero-heavy reference values on the host (never test on zeros)."""
    rng = np.random.default_rng(20240607)
    if dtype == "bool":
        return rng.random(SHAPE) < 0.5
    if dtype == "int64":
        return rng.integers(-(2**40), 2**40, size=SHAPE, dtype=np.int64)  # needs all 8 bytes
    values = (rng.standard_normal(SHAPE) * 50).astype(np.float32)
    if dtype == "bfloat16":
        return values.astype(ml_dtypes.bfloat16)
    if dtype == "float8_e4m3fn":
        return np.clip(values, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return values


def _storage(dtype: str) -> str:
    """What CuPy holds for `dtype`: FP8 crosses as uint8."""
    return "uint8" if dtype == "float8_e4m3fn" else dtype


def _bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def _torch_tensor(torch: Any, a: np.ndarray, dtype: str) -> Any:
    # torch.from_numpy knows no ml_dtypes types: go through same-size integer storage.
    if dtype == "bfloat16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    elif dtype == "float8_e4m3fn":
        t = torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    else:
        t = torch.from_numpy(a)
    return t.to("cuda:0")


def _torch_bytes(torch: Any, t: Any) -> np.ndarray:
    return t.detach().contiguous().view(torch.uint8).cpu().numpy().reshape(-1)


# --------------------------------------------------------------------------------------------------------------------
# torch


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_round_trip_shares_memory(dtype):
    torch, cp = _torch(), _cupy()
    ref = _values(dtype)
    t = _torch_tensor(torch, ref, dtype)
    info = check(t, "x", dtype=dtype, shape=SHAPE, device=t.device.index)
    assert info.framework == "torch" and info.device == ("cuda", t.device.index) and info.contiguous

    c = to_cupy(t, "x")
    assert isinstance(c, cp.ndarray)
    assert c.data.ptr == t.data_ptr()
    assert c.dtype.name == _storage(dtype)
    assert c.shape == SHAPE
    np.testing.assert_array_equal(_bytes(cp.asnumpy(c)), _bytes(ref))

    back = from_cupy(c, "torch", dtype=dtype)
    assert back.data_ptr() == t.data_ptr()
    assert back.dtype == t.dtype
    assert tuple(back.shape) == SHAPE
    np.testing.assert_array_equal(_torch_bytes(torch, back), _bytes(ref))


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_torch_sees_writes_through_the_cupy_view(dtype):
    torch, cp = _torch(), _cupy()
    t = _torch_tensor(torch, _values(dtype), dtype)
    c = to_cupy(t, "x")
    # 0x38 is 1.0 in e4m3; for float32 write 1.0 directly.
    c[3, 5] = 0x38 if dtype == "float8_e4m3fn" else 1.0
    c[0, 0] = 0xC4 if dtype == "float8_e4m3fn" else -3.0  # 0xC4 is -3.0 in e4m3
    cp.cuda.Device(c.data.device_id).synchronize()
    assert t[3, 5].float().item() == 1.0
    assert t[0, 0].float().item() == -3.0


def test_torch_views_keep_strides_and_offsets():
    torch, cp = _torch(), _cupy()
    t = torch.randn(64, 48, device="cuda:0")
    v = t.t()[:, 3:]  # strides (1, 48), starts 3 rows in
    assert not describe(v, "x").contiguous
    c = to_cupy(v, "x")
    assert c.data.ptr == v.data_ptr()
    assert tuple(s // c.itemsize for s in c.strides) == tuple(v.stride())
    np.testing.assert_array_equal(cp.asnumpy(c), v.cpu().numpy())
    with pytest.raises(ArgumentError, match=r"x must be contiguous \(strides \(1, 48\) for shape \(48, 61\)\)"):
        check(v, "x", dtype="float32", device=0)


def test_torch_fp8_view_keeps_strides():
    torch, cp = _torch(), _cupy()
    t = _torch_tensor(torch, _values("float8_e4m3fn"), "float8_e4m3fn")
    v = t[:, 8:40]
    c = to_cupy(v, "x")
    assert c.dtype == cp.uint8
    assert c.data.ptr == v.data_ptr()
    assert c.strides == (64, 1)
    np.testing.assert_array_equal(_bytes(cp.asnumpy(c)), _torch_bytes(torch, v))


def test_torch_tensor_that_requires_grad():
    torch, _ = _torch(), _cupy()
    w = torch.randn(16, 8, device="cuda:0", requires_grad=True)
    c = to_cupy(w, "w")
    assert c.data.ptr == w.data_ptr()


def test_cupy_stream_of_torch_stream_orders_work_and_leaves_the_stream_alive():
    _cupy()
    torch = _torch()
    import gc
    import warnings

    side = torch.cuda.Stream()
    a = torch.zeros(1 << 20, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stream = arrays.cupy_stream(side.cuda_stream, torch.cuda.current_device())
    with stream:  # CuPy's work goes onto torch's side stream
        view = to_cupy(a, "a")
        view += 1
    assert stream.ptr == side.cuda_stream
    del stream
    gc.collect()  # CuPy must not destroy a stream it did not create
    with torch.cuda.stream(side):
        a += 1
    side.synchronize()
    assert float(a.min()) == 2.0 and float(a.max()) == 2.0


def test_torch_wrong_gpu_message():
    torch, _ = _torch(), _cupy()
    t = torch.ones(4, device="cuda:0")
    with pytest.raises(ArgumentTypeError, match=r"^x is on cuda:0 but this rank's GPU is cuda:7$"):
        check(t, "x", dtype="float32", device=7)


# --------------------------------------------------------------------------------------------------------------------
# JAX


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_round_trip_shares_memory(dtype):
    (jax, gpu), cp = _jax(), _cupy()
    ref = _values(dtype)
    with _x64(jax, dtype == "int64"):
        x = jax.device_put(ref, gpu)
        assert describe(x, "x").dtype == dtype
        info = check(x, "x", dtype=dtype, shape=SHAPE, device=gpu.local_hardware_id)
        assert info.framework == "jax" and info.device == ("cuda", gpu.local_hardware_id)

        c = to_cupy(x, "x")
        assert isinstance(c, cp.ndarray)
        assert c.dtype.name == _storage(dtype)
        assert c.shape == SHAPE
        assert c.data.ptr == x.unsafe_buffer_pointer()  # FP8 too: the DLPack capsule is retyped, not the data
        np.testing.assert_array_equal(_bytes(cp.asnumpy(c)), _bytes(ref))

        back = from_cupy(c, "jax", dtype=dtype)
        assert back.dtype == x.dtype
        assert back.shape == SHAPE
        assert back.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
        np.testing.assert_array_equal(_bytes(np.asarray(back)), _bytes(ref))


def test_jax_without_x64_int64_is_refused_not_narrowed():
    (jax, _), cp = _jax(), _cupy()
    if jax.config.jax_enable_x64:
        pytest.skip("jax_enable_x64 is on in this process")
    c = cp.arange(2**33, 2**33 + 10, dtype=cp.int64)
    with pytest.raises(ArgumentTypeError, match=r"^JAX turned layout_range from int64 into int32 .*jax_enable_x64"):
        from_cupy(c, "jax", name="layout_range")


def test_jax_refuses_non_contiguous_cupy_arrays():
    _jax()
    cp = _cupy()
    c = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    with pytest.raises(ArgumentError, match="must be contiguous to become a JAX array"):
        from_cupy(c.T, "jax")


# --------------------------------------------------------------------------------------------------------------------
# CuPy


@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_in_and_out_is_the_same_array(dtype):
    cp = _cupy()
    ref = _values(dtype)
    c = cp.asarray(ref.view(np.uint8) if dtype == "float8_e4m3fn" else ref)
    info = check(c, "x", dtype=_storage(dtype), shape=SHAPE, device=c.data.device_id)
    assert info.framework == "cupy" and info.device == ("cuda", c.data.device_id) and info.contiguous
    assert to_cupy(c, "x") is c
    assert from_cupy(c, "cupy", dtype=dtype) is c  # CuPy has no float8: FP8 stays uint8 storage
    np.testing.assert_array_equal(_bytes(cp.asnumpy(c)), _bytes(ref))


def test_cupy_messages_on_a_gpu():
    cp = _cupy()
    c = cp.arange(32, dtype=cp.float32).reshape(4, 8)
    ordinal = c.data.device_id
    with pytest.raises(ArgumentTypeError, match=rf"^x is on cuda:{ordinal} but this rank's GPU is cuda:{ordinal + 1}$"):
        check(c, "x", dtype="float32", device=ordinal + 1)
    with pytest.raises(ArgumentError, match=r"strides \(1, 8\) for shape \(8, 4\)\); pass cupy.ascontiguousarray"):
        check(c.T, "x", dtype="float32", device=ordinal)
    with pytest.raises(ArgumentTypeError, match="cannot be handed to NumPy without a copy"):
        from_cupy(c, "numpy", name="recv_x")


# --------------------------------------------------------------------------------------------------------------------
# Across frameworks


def test_torch_to_jax_through_cupy_shares_memory():
    torch, (_, gpu) = _torch(), _jax()
    _cupy()
    if gpu.local_hardware_id != 0:
        pytest.skip("JAX's first GPU is not cuda:0")
    ref = _values("bfloat16")
    t = _torch_tensor(torch, ref, "bfloat16")
    x = from_cupy(to_cupy(t, "x"), "jax")
    assert x.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(_bytes(np.asarray(x)), _bytes(ref))
    with pytest.raises(ArgumentTypeError, match="x is a torch tensor but y is a JAX array"):
        arrays.check_same_framework({"x": t, "y": x})
