"""The reference's input checks: every argument converted to a host NumPy array, then checked, with the argument's
name, the simulated rank index (``topk_idx[2]``) and the values in the message."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError, check_int, with_rank
from .results import BF16, FP8, FP8_BLOCK, POISON_BF16_BITS


def host_array(value: Any) -> np.ndarray:
    """``value`` as a NumPy array on the host, whatever framework made it: NumPy arrays as they are; torch tensors
    (any device) detached and copied to the host, bf16 as ``ml_dtypes.bfloat16`` and float8_e4m3fn as
    ``ml_dtypes.float8_e4m3fn`` with the same bits (torch's own ``.numpy()`` refuses both); CuPy arrays copied to the
    host; JAX arrays, lists and scalars through ``np.asarray`` (JAX's bf16 is ml_dtypes' already); any other object
    with ``__dlpack__`` and no ``__array__`` through ``np.from_dlpack``."""
    if isinstance(value, np.ndarray):
        return value
    root = (type(value).__module__ or "").partition(".")[0]
    # A torch tensor or CuPy array can only exist once its framework is imported, so sys.modules has it: the
    # reference never imports a framework itself.
    torch = sys.modules.get("torch") if root == "torch" else None
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(BF16)
        if tensor.dtype == getattr(torch, "float8_e4m3fn", None):  # torch < 2.1 has no FP8
            return tensor.view(torch.uint8).numpy().view(FP8)
        return tensor.numpy()
    cupy = sys.modules.get("cupy") if root == "cupy" else None
    if cupy is not None and isinstance(value, cupy.ndarray):
        return cupy.asnumpy(value)
    if hasattr(value, "__dlpack__") and not hasattr(value, "__array__"):
        return np.from_dlpack(value)
    return np.asarray(value)


def argument_error(message: str) -> ArgumentError:
    return ArgumentError(with_rank(message))


def type_error(message: str) -> ArgumentTypeError:
    return ArgumentTypeError(with_rank(message))


def per_rank(name: str, values: Any, num_ranks: int | None = None) -> list[Any]:
    """Check that ``values`` is a list with one entry per rank (a bare array is the usual mistake)."""
    if isinstance(values, np.ndarray) or not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise type_error(f"{name} must be a list with one entry per rank, got {type(values).__name__}")
    if num_ranks is None:
        if len(values) == 0:
            raise argument_error(f"{name} is empty: give one entry per rank (at least one rank)")
    elif len(values) != num_ranks:
        raise argument_error(f"{name} has {len(values)} entries but there are {num_ranks} ranks")
    return list(values)


def check_num_experts(num_experts: int, num_ranks: int) -> tuple[int, int]:
    """``(num_experts, num_experts / num_ranks)`` as ints, after checking both."""
    num_experts, num_ranks = check_int(num_experts, "num_experts", None), check_int(num_ranks, "num_ranks", 1)
    if num_experts < 1 or num_experts % num_ranks != 0:
        raise argument_error(f"num_experts={num_experts} must be a positive multiple of num_ranks={num_ranks}")
    return num_experts, num_experts // num_ranks


def check_num_nvl_ranks(num_nvl_ranks: Any, num_ranks: int) -> int | None:
    """``num_nvl_ranks`` as an int >= 1 dividing ``num_ranks``; None when it is None or ``num_ranks`` (one node)."""
    if num_nvl_ranks is None:
        return None
    num_nvl_ranks = check_int(num_nvl_ranks, "num_nvl_ranks", None)
    if num_nvl_ranks < 1 or num_ranks % num_nvl_ranks != 0:
        raise argument_error(f"num_nvl_ranks={num_nvl_ranks} must be >= 1 and divide num_ranks={num_ranks}")
    return None if num_nvl_ranks == num_ranks else num_nvl_ranks


def is_float_dtype(dtype: np.dtype) -> bool:
    return dtype == BF16 or np.issubdtype(dtype, np.floating)


def check_topk_idx(
    topk_idx: Any, name: str, num_tokens: int | None, num_topk: int | None, num_experts: int
) -> np.ndarray:
    """Return ``topk_idx`` as int64 ``[N, K]`` after checking its shape and that it lies in ``[-1, num_experts)``."""
    idx = host_array(topk_idx)
    if not np.issubdtype(idx.dtype, np.integer):
        raise type_error(f"{name} must have an integer dtype (int64), got {idx.dtype}")
    if idx.ndim != 2:
        raise argument_error(f"{name} must be 2-D [num_tokens, num_topk], got shape {idx.shape}")
    if num_tokens is not None and idx.shape[0] != num_tokens:
        raise argument_error(f"{name} has {idx.shape[0]} rows but the rank has {num_tokens} tokens")
    if num_topk is not None and idx.shape[1] != num_topk:
        raise argument_error(f"{name} has num_topk={idx.shape[1]} but rank 0 has num_topk={num_topk}")
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= num_experts:
            raise argument_error(f"{name} has values in [{lo}, {hi}] but must lie in [-1, {num_experts}) (num_experts)")
    return idx.astype(np.int64, copy=False)


def check_topk_weights(topk_weights: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
    w = host_array(topk_weights)
    if not is_float_dtype(w.dtype):
        raise type_error(f"{name} must be floating point (float32), got {w.dtype}")
    if w.shape != shape:
        raise argument_error(f"{name} has shape {w.shape} but topk_idx has shape {shape}")
    return w.astype(np.float32, copy=False)


def check_bf16(x: Any, name: str, ndim: int) -> np.ndarray:
    arr = host_array(x)
    if arr.dtype != BF16:
        raise type_error(f"{name} must be bfloat16 (ml_dtypes.bfloat16), got {arr.dtype}")
    if arr.ndim != ndim:
        raise argument_error(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return arr


def check_fp8_bits(x: Any, name: str) -> np.ndarray:
    """Accept FP8 data as uint8 bits or as float8_e4m3fn values; return the uint8 bits."""
    arr = host_array(x)
    if arr.dtype == FP8:
        return arr.view(np.uint8)
    if arr.dtype != np.uint8:
        raise type_error(
            f"{name} must be FP8 e4m3 (uint8 bits or float8_e4m3fn) since x_scales were given, got {arr.dtype}"
        )
    return arr


def check_hidden_fp8(hidden: int, name: str) -> None:
    if hidden % FP8_BLOCK != 0:
        raise argument_error(f"{name} has hidden={hidden}, which must be a multiple of {FP8_BLOCK} for FP8")


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def poison_bf16(shape: tuple[int, ...]) -> np.ndarray:
    return np.full(shape, POISON_BF16_BITS, dtype=np.uint16).view(BF16)
