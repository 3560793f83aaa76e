"""CPU tier for epjit.arrays: metadata, validation messages, and the NumPy side of the round trip.

Runs with NumPy and ml_dtypes only; the torch and JAX parts that need no GPU run where those are installed and skip
otherwise. The GPU round trips are in test_arrays_gpu.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from epjit import arrays, errors
from epjit.arrays import ArrayInfo, check, check_same_framework, describe, dlpack, from_cupy, meta, to_cupy, validate
from epjit.errors import ArgumentError, ArgumentTypeError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def rank3():
    errors.set_rank(3)
    try:
        yield
    finally:
        errors.set_rank(None)


def _rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def _random(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Non-trivial values of every dtype epjit names (never zeros)."""
    rng = _rng()
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in ("int64", "int32", "uint8"):
        return rng.integers(1, 100, size=shape).astype(dtype)
    values = rng.standard_normal(shape).astype(np.float32) * 10
    if dtype == "bfloat16":
        return values.astype(ml_dtypes.bfloat16)
    if dtype == "float8_e4m3fn":
        return values.astype(ml_dtypes.float8_e4m3fn)
    return values.astype(dtype)


# --------------------------------------------------------------------------------------------------------------------
# describe()


@pytest.mark.parametrize("dtype", arrays.DTYPES)
def test_describe_names_every_epjit_dtype(dtype):
    a = _random((3, 5), dtype)
    info = describe(a, "x")
    assert info == ArrayInfo("numpy", dtype, (3, 5), (5, 1), ("cpu", 0), True)
    assert info.ndim == 2


def test_describe_names_other_dtypes_as_numpy_does():
    assert describe(np.ones(4, np.float64), "x").dtype == "float64"
    assert describe(np.ones(4, np.int8), "x").dtype == "int8"


def test_describe_reports_strides_in_elements():
    a = np.empty((4, 6, 8), dtype=ml_dtypes.bfloat16)
    info = describe(a, "x")
    assert info.strides == (48, 8, 1)
    assert info.shape == (4, 6, 8)
    assert describe(a[:, ::2, :], "x").strides == (48, 16, 1)


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a.T,
        lambda a: a[:, ::2],
        lambda a: a[:, :3],
        lambda a: a[::-1],
        lambda a: a[:, :1],  # shape (4, 1) but rows 8 apart: torch also calls this non-contiguous
        lambda a: np.broadcast_to(a[:1], (4, 8)),
    ],
    ids=["transposed", "every-other-column", "column-slice", "reversed", "first-column", "broadcast"],
)
def test_describe_detects_non_contiguous_views(view):
    a = np.arange(32, dtype=np.float32).reshape(4, 8)
    assert not describe(view(a), "x").contiguous


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a,
        lambda a: a[1:3],
        lambda a: a[:1, :],
        lambda a: a[2],
        lambda a: a[:, 0:0],  # size 0: contiguous whatever the strides say
        lambda a: a[0:0, ::2],
        lambda a: a.reshape(4, 1, 8),
        lambda a: np.asarray(a[0, 0]),  # 0-d
    ],
    ids=["whole", "row-slice", "one-row", "row", "empty-columns", "empty-strided", "size1-dim", "scalar"],
)
def test_describe_accepts_contiguous_views(view):
    a = np.arange(32, dtype=np.float32).reshape(4, 8)
    assert describe(view(a), "x").contiguous


def test_size_one_dims_may_have_any_stride():
    a = np.arange(12, dtype=np.int32)
    # Strides of size-1 dimensions are never used to address memory, so any value is fine (torch's rule).
    odd = np.lib.stride_tricks.as_strided(a, shape=(1, 6, 1), strides=(4000, 4, 12345 * 4))
    info = describe(odd, "x")
    assert info.strides == (1000, 1, 12345)
    assert info.contiguous
    stale = np.lib.stride_tricks.as_strided(a, shape=(6, 1), strides=(8, 4))
    assert not describe(stale, "x").contiguous  # rows 2 elements apart


@pytest.mark.parametrize(
    ("obj", "shown"),
    [
        ([1, 2, 3], "list"),
        (None, "None"),
        ((1, 2), "tuple"),
        (3.5, "float"),
        (np.float32(1.0), "numpy.float32"),
        ({"x": 1}, "dict"),
    ],
)
def test_unknown_objects_are_type_errors(obj, shown):
    with pytest.raises(ArgumentTypeError) as exc:
        describe(obj, "x")
    assert str(exc.value) == f"x must be a torch/JAX/CuPy array, got {shown}"
    assert isinstance(exc.value, TypeError)


def test_lookalike_types_are_not_arrays():
    # A type claiming to live in torch/jax/cupy is only an array if that framework is loaded and says so; looking it
    # up never imports the framework.
    fakes = {root: type("Tensor", (), {"__module__": f"{root}.fake"})() for root in ("torch", "jaxlib", "cupy")}
    for root, fake in fakes.items():
        with pytest.raises(ArgumentTypeError, match=re.escape(f"got {root}.fake.Tensor")):
            describe(fake, "x")


def test_unknown_object_message_carries_rank(rank3):
    with pytest.raises(ArgumentTypeError) as exc:
        describe([1], "topk_idx")
    assert str(exc.value) == "topk_idx must be a torch/JAX/CuPy array, got list (rank 3)"


# --------------------------------------------------------------------------------------------------------------------
# check()


def test_check_returns_info_when_everything_matches():
    x = _random((128, 64), "bfloat16")
    info = check(x, "x", dtype="bfloat16", shape=(("N", 128), "H"), device="any")
    assert info.shape == (128, 64)
    assert info.dtype == "bfloat16"


def test_wrong_dtype_message(rank3):
    with pytest.raises(ArgumentTypeError) as exc:
        check(_random((4, 8), "float32"), "x", dtype="bfloat16", device="any")
    assert str(exc.value) == "x must be bfloat16, got float32 (rank 3)"


def test_wrong_dtype_message_without_rank():
    with pytest.raises(ArgumentTypeError) as exc:
        check(_random((4, 8), "float32"), "x", dtype="bfloat16", device="any")
    assert str(exc.value) == "x must be bfloat16, got float32"


@pytest.mark.parametrize(
    ("wanted", "text"),
    [
        (("bfloat16", "float8_e4m3fn"), "x must be bfloat16 or float8_e4m3fn, got int32"),
        (("bfloat16", "float16", "float32"), "x must be one of bfloat16, float16, float32, got int32"),
    ],
)
def test_dtype_alternatives_are_listed(wanted, text):
    with pytest.raises(ArgumentTypeError) as exc:
        check(_random((2,), "int32"), "x", dtype=wanted, device="any")
    assert str(exc.value) == text


@pytest.mark.parametrize(
    ("given", "wanted"),
    [("bool", "uint8"), ("uint8", "bool"), ("bfloat16", "float16"), ("uint8", "float8_e4m3fn"), ("int64", "int32")],
)
def test_dtype_names_in_messages(given, wanted):
    with pytest.raises(ArgumentTypeError, match=f"^x must be {wanted}, got {given}$"):
        check(_random((3,), given), "x", dtype=wanted, device="any")


def test_unknown_dtype_name_is_a_caller_bug():
    with pytest.raises(ValueError, match="bf16"):
        check(_random((3,), "float32"), "x", dtype="bf16", device="any")


def test_shape_message_with_readable_description(rank3):
    topk_idx = _random((127, 8), "int64")
    with pytest.raises(ArgumentError) as exc:
        check(
            topk_idx, "topk_idx", dtype="int64", shape=(("N", 128), "K"), shape_note="with N matching x", device="any"
        )
    assert str(exc.value) == "topk_idx must have shape [N=128, K] with N matching x, got [127, 8] (rank 3)"
    assert isinstance(exc.value, ValueError)


def test_shape_message_for_wrong_number_of_dims():
    with pytest.raises(ArgumentError) as exc:
        check(_random((128,), "int64"), "topk_idx", dtype="int64", shape=(("N", 128), "K"), device="any")
    assert str(exc.value) == "topk_idx must have shape [N=128, K], got [128]"


def test_shape_spec_plain_ints_and_wildcards():
    x = _random((4, 7168), "bfloat16")
    assert check(x, "x", dtype="bfloat16", shape=(None, 7168), device="any").shape == (4, 7168)
    with pytest.raises(ArgumentError) as exc:
        check(x, "x", dtype="bfloat16", shape=(None, 4096), device="any")
    assert str(exc.value) == "x must have shape [*, 4096], got [4, 7168]"


def test_bad_shape_spec_is_a_caller_bug():
    with pytest.raises(TypeError, match="shape spec"):
        check(_random((4,), "int32"), "x", dtype="int32", shape=(4.0,), device="any")


def test_ndim_message():
    with pytest.raises(ArgumentError) as exc:
        check(_random((2, 3, 4), "float32"), "x", dtype="float32", ndim=2, device="any")
    assert str(exc.value) == "x must be 2-D, got 3-D shape [2, 3, 4]"
    assert check(_random((2, 3), "float32"), "x", dtype="float32", ndim=2, device="any").ndim == 2


def test_size_zero_and_one_dims_pass_shape_checks():
    empty = _random((0, 8), "bfloat16")
    assert check(empty, "x", dtype="bfloat16", shape=(("N", 0), 8), device="any").contiguous
    single = _random((1, 8), "bfloat16")
    assert check(single, "x", dtype="bfloat16", shape=(1, 8), device="any").shape == (1, 8)


def test_not_contiguous_message(rank3):
    x = np.empty((7168, 4096), dtype=np.uint8).T  # never touched: np.empty only reserves the pages
    with pytest.raises(ArgumentError) as exc:
        check(x, "x", dtype="uint8", device="any")
    assert str(exc.value).startswith("x must be contiguous (strides (1, 4096) for shape (4096, 7168))")
    assert "numpy.ascontiguousarray(x)" in str(exc.value)
    assert str(exc.value).endswith(" (rank 3)")


def test_sliced_rows_are_not_contiguous():
    x = _random((16, 8), "bfloat16")[:, :4]
    with pytest.raises(ArgumentError, match=re.escape("x must be contiguous (strides (8, 1) for shape (16, 4))")):
        check(x, "x", dtype="bfloat16", device="any")
    assert not check(x, "x", dtype="bfloat16", device="any", contiguous=False).contiguous


def test_numpy_array_where_a_gpu_is_needed(rank3):
    x = _random((4, 8), "bfloat16")
    for device in (0, None):
        with pytest.raises(ArgumentTypeError) as exc:
            check(x, "x", dtype="bfloat16", device=device)
        assert str(exc.value) == "x must be on a CUDA device, got a NumPy array on the CPU (rank 3)"


def test_default_device_requirement_is_a_cuda_device():
    with pytest.raises(ArgumentTypeError, match="must be on a CUDA device"):
        check(_random((4,), "float32"), "x", dtype="float32")


def test_wrong_gpu_message(monkeypatch, rank3):
    # No GPU here: feed check() the metadata a CuPy array on cuda:1 would have.
    on_gpu1 = ArrayInfo("cupy", "bfloat16", (4, 8), (8, 1), ("cuda", 1), True)
    monkeypatch.setattr(validate, "describe", lambda obj, name: on_gpu1)
    with pytest.raises(ArgumentTypeError) as exc:
        check(object(), "x", dtype="bfloat16", device=0)
    assert str(exc.value) == "x is on cuda:1 but this rank's GPU is cuda:0 (rank 3)"
    assert check(object(), "x", dtype="bfloat16", device=1) is on_gpu1
    assert check(object(), "x", dtype="bfloat16", device=None) is on_gpu1


def test_checks_run_dtype_before_shape_before_device():
    x = _random((3,), "float32")
    with pytest.raises(ArgumentTypeError, match="must be int64"):
        check(x, "x", dtype="int64", shape=(4,), device=0)
    with pytest.raises(ArgumentError, match="must have shape"):
        check(x, "x", dtype="float32", shape=(4,), device=0)


# --------------------------------------------------------------------------------------------------------------------
# check_same_framework()


def test_same_framework_returns_it_and_skips_missing():
    assert check_same_framework({"x": _random((2,), "float32"), "bias": None, "w": _random((2,), "int32")}) == "numpy"
    assert check_same_framework([("x", None)]) is None
    assert check_same_framework({}) is None


def test_mixed_frameworks_message(monkeypatch, rank3):
    frameworks = {"x": "torch", "topk_idx": "jax"}
    monkeypatch.setattr(validate, "_framework", lambda obj, name: frameworks[name])
    with pytest.raises(ArgumentTypeError) as exc:
        check_same_framework([("x", object()), ("topk_idx", object())])
    assert str(exc.value) == (
        "x is a torch tensor but topk_idx is a JAX array; pass every array of one call from the same framework (rank 3)"
    )


def test_same_framework_rejects_non_arrays():
    with pytest.raises(ArgumentTypeError, match="^w must be a torch/JAX/CuPy array, got list$"):
        check_same_framework({"x": _random((2,), "float32"), "w": [1.0]})


# --------------------------------------------------------------------------------------------------------------------
# to_cupy() / from_cupy() on the CPU side


def test_to_cupy_refuses_numpy_arrays(rank3):
    with pytest.raises(ArgumentTypeError) as exc:
        to_cupy(_random((4,), "float32"), "x")
    assert (
        str(exc.value) == "x must be on a CUDA device to reach epjit's kernels, got a NumPy array on the CPU (rank 3)"
    )


def test_to_cupy_refuses_non_arrays():
    with pytest.raises(ArgumentTypeError, match="^x must be a torch/JAX/CuPy array, got list$"):
        to_cupy([1, 2], "x")


def test_from_cupy_numpy_is_the_same_array():
    a = _random((4, 8), "bfloat16")
    assert from_cupy(a, "numpy") is a
    assert from_cupy(a, "numpy", dtype="bfloat16") is a


def test_from_cupy_numpy_fp8_is_a_view_of_the_uint8_storage():
    fp8 = _random((4, 8), "float8_e4m3fn")
    storage = fp8.view(np.uint8)
    out = from_cupy(storage, "numpy", dtype="float8_e4m3fn")
    assert out.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert out.shape == (4, 8)
    assert np.shares_memory(out, storage)
    np.testing.assert_array_equal(out.astype(np.float32), fp8.astype(np.float32))


def test_from_cupy_only_reinterprets_uint8_as_fp8():
    with pytest.raises(ArgumentTypeError) as exc:
        from_cupy(_random((4,), "float32"), "numpy", dtype="float8_e4m3fn", name="recv_x")
    assert (
        str(exc.value) == "recv_x is float32; only uint8 storage can be handed out as float8 (asked for float8_e4m3fn)"
    )
    with pytest.raises(ValueError, match="fp8"):
        from_cupy(_random((4,), "uint8"), "numpy", dtype="fp8")


def test_from_cupy_will_not_move_numpy_to_a_gpu_framework():
    with pytest.raises(ArgumentTypeError, match="NumPy array on the CPU and cannot become a torch GPU array"):
        from_cupy(_random((4,), "float32"), "torch")


def test_from_cupy_names_bad_frameworks():
    with pytest.raises(ArgumentError, match=r"framework must be one of torch, jax, cupy, numpy, got 'tensorflow'"):
        from_cupy(_random((4,), "float32"), "tensorflow")
    with pytest.raises(ArgumentTypeError, match="^output must be a torch/JAX/CuPy array, got list$"):
        from_cupy([1.0], "numpy")


def test_from_cupy_refuses_gpu_memory_for_numpy(monkeypatch):
    on_gpu = ArrayInfo("cupy", "float32", (4,), (1,), ("cuda", 0), True)
    monkeypatch.setattr(dlpack, "describe", lambda obj, name: on_gpu)
    with pytest.raises(ArgumentTypeError, match=r"recv_x is GPU memory \(a CuPy array on cuda:0\).*asnumpy"):
        from_cupy(object(), "numpy", name="recv_x")


class _Legacy:
    """Forces the unversioned DLPack capsule ("dltensor"), as JAX and older exporters produce."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        kwargs.pop("max_version", None)
        return self._arr.__dlpack__(**kwargs)


@pytest.mark.parametrize("legacy", [False, True], ids=["dltensor_versioned", "dltensor"])
def test_retyped_capsule_is_a_view_with_the_new_type(legacy):
    # The JAX FP8 path rewrites the DLTensor's type code; NumPy can check the struct offsets of both capsule kinds on
    # the CPU: uint8 storage retyped as kDLInt (0) must come back as an int8 view of the same bytes.
    storage = np.array([[200, 3, 129], [7, 255, 64]], dtype=np.uint8)
    source = _Legacy(storage) if legacy else storage
    out = np.from_dlpack(dlpack._Retyped(source, 0, "x"))
    assert out.dtype == np.int8
    assert out.shape == (2, 3)
    assert np.shares_memory(out, storage)
    np.testing.assert_array_equal(out, storage.view(np.int8))
    assert out[0, 0] == -56


def test_retyping_refuses_wider_types_and_consumed_capsules():
    with pytest.raises(ArgumentTypeError, match="^x: expected an 8-bit DLPack tensor, got code 2 with 32 bits$"):
        np.from_dlpack(dlpack._Retyped(np.ones(4, np.float32), 1, "x"))
    capsule = np.ones(4, np.uint8).__dlpack__()
    with pytest.raises(ArgumentTypeError, match="no unconsumed DLPack capsule"):
        dlpack._retype_capsule(object(), 1, "x")
    dlpack._retype_capsule(capsule, 0, "x")  # an unconsumed capsule is accepted


# --------------------------------------------------------------------------------------------------------------------
# Import hygiene


def test_import_does_not_load_frameworks():
    code = (
        "import sys, numpy as np\n"
        "import epjit.arrays as A\n"
        "A.check(np.ones((2, 3), np.float32), 'x', dtype='float32', device='any')\n"
        "A.check_same_framework({'x': np.ones(2)})\n"
        "try:\n"
        "    A.describe([1], 'x')\n"
        "except TypeError:\n"
        "    pass\n"
        "print(sorted(m for m in ('torch', 'jax', 'jaxlib', 'cupy', 'cupy_backends', 'mpi4py') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------------------------------
# torch and JAX metadata without a GPU (run where they are installed)


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    t = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    assert describe(t, "x") == ArrayInfo("torch", "float32", (4, 8), (8, 1), ("cpu", 0), True)
    assert describe(t.t(), "x").strides == (1, 8)
    assert not describe(t.t(), "x").contiguous
    assert not describe(t[:, :3], "x").contiguous
    assert describe(t[1:3], "x").contiguous
    for dtype, named in [
        (torch.bfloat16, "bfloat16"),
        (torch.float8_e4m3fn, "float8_e4m3fn"),
        (torch.bool, "bool"),
        (torch.int64, "int64"),
        (torch.uint8, "uint8"),
        (torch.float16, "float16"),
    ]:
        assert describe(t.to(dtype), "x").dtype == named
    assert describe(torch.nn.Parameter(t), "w").framework == "torch"
    with pytest.raises(ArgumentTypeError, match=r"^x must be on a CUDA device, got a torch tensor on the CPU$"):
        check(t, "x", dtype="float32", device=0)
    with pytest.raises(ArgumentError, match=re.escape("x must be contiguous (strides (1, 8) for shape (8, 4)); pass")):
        check(t.t(), "x", dtype="float32", device="any")
    with pytest.raises(ArgumentTypeError, match="got a torch tensor on the CPU"):
        to_cupy(t, "x")


def test_jax_cpu_arrays():
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError as exc:
        pytest.skip(f"JAX has no CPU backend here: {exc}")
    x = jax.device_put(jnp.arange(12, dtype=jnp.float32).reshape(3, 4), cpu)
    assert describe(x, "x") == ArrayInfo("jax", "float32", (3, 4), (4, 1), ("cpu", 0), True)
    assert describe(x.astype(jnp.bfloat16), "x").dtype == "bfloat16"
    assert describe(x > 2, "x").dtype == "bool"
    with pytest.raises(ArgumentTypeError, match=r"^x must be on a CUDA device, got a JAX array on the CPU$"):
        check(x, "x", dtype="float32", device=0)

    @jax.jit
    def traced(y):
        describe(y, "y")
        return y

    with pytest.raises(ArgumentTypeError, match="y is a JAX tracer"):
        traced(x)


def test_cupy_storage_dtypes():
    import ml_dtypes

    assert arrays.cupy_dtype("float8_e4m3fn") == np.uint8  # CuPy has no float8: FP8 travels as bytes
    assert arrays.cupy_dtype("bfloat16") == ml_dtypes.bfloat16
    assert arrays.cupy_dtype("int64") == np.int64


def test_cupy_stream_wraps_an_address_without_deprecation_warnings():
    cupy = pytest.importorskip("cupy")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CuPy 14's ExternalStream warns: an error here
        stream = arrays.cupy_stream(0x7F00_1234, 0)
    assert stream.ptr == 0x7F00_1234
    assert arrays.cupy_stream(0, 0) is cupy.cuda.Stream.null  # torch's legacy default stream


class _FakeTensor:
    """What fingerprint reads of a torch tensor, without torch."""

    def __init__(self, dtype: str, shape: tuple[int, ...], contiguous: bool = True, device: int = 0) -> None:
        self.dtype, self.shape, self._contiguous, self._device = dtype, shape, contiguous, device

    def is_contiguous(self) -> bool:
        return self._contiguous

    def get_device(self) -> int:
        return self._device

    def data_ptr(self) -> int:
        return 0x7F00_0000_0000


def test_fingerprints_tell_apart_everything_a_check_judges(monkeypatch):
    """A call's plan is reused only for arrays whose fingerprints equal those it was validated for: every property
    check() judges (dtype, shape, contiguity, device) must change the fingerprint; anything that is not a plain
    tensor or CuPy array has none (its every call is checked in full)."""
    import types

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(Tensor=_FakeTensor))
    monkeypatch.setattr(meta, "_TORCH_TENSOR", None)
    fp = arrays.fingerprint
    base = fp(_FakeTensor("bfloat16", (128, 7168)))
    assert base is not None and base == fp(_FakeTensor("bfloat16", (128, 7168)))
    for other in (_FakeTensor("float32", (128, 7168)), _FakeTensor("bfloat16", (127, 7168)),
                  _FakeTensor("bfloat16", (128, 7168), contiguous=False),
                  _FakeTensor("bfloat16", (128, 7168), device=1), _FakeTensor("bfloat16", (128, 7168), device=-1)):
        assert fp(other) != base
    assert fp(None) == () and fp(np.zeros(3)) is None and fp(object()) is None
    pair = fp((_FakeTensor("float8_e4m3fn", (8, 128)), _FakeTensor("float32", (8, 1))))
    assert pair is not None and pair != fp([_FakeTensor("float8_e4m3fn", (8, 128)), _FakeTensor("float32", (8, 1))])
    assert fp((_FakeTensor("float8_e4m3fn", (8, 128)), np.zeros(3))) is None  # one part unknown: no fingerprint

    class Sub(_FakeTensor):  # a subclass (torch.nn.Parameter, say) is checked in full
        pass

    assert fp(Sub("bfloat16", (128, 7168))) is None
    assert arrays.address(_FakeTensor("bfloat16", (1, 8))) == 0x7F00_0000_0000 and arrays.address(None) == 0
