"""Low-latency FP8 scales from epjit's layout to the one DeepEP returns (DeepGEMM's), with torch ops; and normal-mode
FP8 input scales in DeepGEMM's column-major layout made row-major, as epjit's kernels read them.

epjit returns ``x_scales`` row-major: ``[L, R*M, H/128]`` float32, or uint8 exponents with ``use_ue8m0``.
DeepEP returns the same logical shape with the last two dimensions column-major (token-major in memory: all rows of
one scale group together), which DeepGEMM's TMA loads need:

- float32 ``[L, R*M, H/128]``, strides ``(H/128 * R*M, 1, R*M)``;
- with ``use_ue8m0``, int32 ``[L, R*M, H/512]``, strides ``(H/512 * R*M, 1, R*M)``: byte ``j`` of element
  ``[e, t, g]`` (in memory order) is the exponent of scale group ``4g + j``.

The conversion is a copy into a tensor allocated transposed; the UE8M0 packing is a view of each row's four
exponent bytes as one int32 (memory order is kept, so it is exact on any byte order).
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import ArgumentError, ArgumentTypeError, with_rank

UE8M0_PER_INT = 4  # exponent bytes packed into one int32


def check_ue8m0_hidden(hidden: int) -> None:
    """DeepEP's UE8M0 layout packs four scale groups into each int32: hidden must be a multiple of 512."""
    if hidden % (128 * UE8M0_PER_INT):
        raise ArgumentError(with_rank(
            f"use_ue8m0=True packs four scale exponents into each int32 (DeepEP's layout), so hidden must be a "
            f"multiple of 512, got hidden={hidden}"))


def empty_deepgemm_scales(scales: Any, use_ue8m0: bool) -> Any:
    """An uninitialised tensor of DeepEP's scale layout for epjit's ``scales`` [L, rows, H/128]."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(scales, torch.Tensor):
        raise ArgumentTypeError(with_rank(f"DeepEP's low-latency FP8 scales are torch tensors: x must be a torch "
                                          f"tensor, got scales of type {type(scales).__name__}"))
    num_local, rows, groups = scales.shape
    if use_ue8m0:
        check_ue8m0_hidden(groups * 128)
        groups //= UE8M0_PER_INT
    dtype = torch.int32 if use_ue8m0 else torch.float32
    return torch.empty((num_local, groups, rows), dtype=dtype, device=scales.device).transpose(1, 2)


def fill_deepgemm_scales(out: Any, scales: Any, use_ue8m0: bool) -> Any:
    """Copy epjit's ``scales`` into ``out`` (from :func:`empty_deepgemm_scales`) on the current stream."""
    out.copy_(scales.view(sys.modules["torch"].int32) if use_ue8m0 else scales)
    return out


def deepgemm_scales(scales: Any, use_ue8m0: bool) -> Any:
    """epjit's low-latency ``x_scales`` in DeepEP's layout (a new tensor, written on the current stream)."""
    return fill_deepgemm_scales(empty_deepgemm_scales(scales, use_ue8m0), scales, use_ue8m0)


def is_column_major_scales(x: Any) -> bool:
    """Whether a normal-mode dispatch's ``x`` is an FP8 pair ``(tokens, scales)`` whose scales are a column-major
    torch view: ``[N, G]`` with strides ``(1, N)`` (``scales.T.contiguous().T``, what DeepGEMM-style per-token-group
    quantisers hand over). DeepEP's kernels read the scales through their strides; epjit's read them row-major."""
    if len(x) != 2:
        return False
    scales = x[1]
    is_contiguous = getattr(scales, "is_contiguous", None)  # torch's method: checked first, the common answer
    if not callable(is_contiguous) or is_contiguous():
        return False
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(scales, torch.Tensor) or scales.dim() != 2:
        return False
    return scales.stride() == (1, scales.shape[0])
